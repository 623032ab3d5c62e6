"""torch.profiler over a window of steps, written as a Chrome trace (chrome://tracing, Perfetto).

Each rank writes `profile/trace_rank<r>.json` in the run's output directory and logs it to the
MLflow run under `profile/`. While it records, the step phases are labelled in the trace.

The window is torch's own `schedule`: the step before it warms the profiler up (its start-up
cost stays out of the recorded steps), the window's steps are recorded, and the trace is
written when the last one ends. The schedule counts from the first step this process runs, so
a resumed run profiles the same steps, or none if it resumed past them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, device: torch.device, start_step: int, steps: int, out: Path) -> None:
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.start_step, self.steps = start_step, steps
        self.path = out
        self.prof: profile | None = None
        self.started = False  # the schedule is set up on the first step this process ran
        self.written = False

    def after_step(self, step: int) -> bool:
        """Advance the schedule; True while the next step is profiled (warm-up or recording)."""
        if not self.started:
            self.started = True
            before = self.start_step - 1 - step  # steps to run before the window
            if before < 0:
                log.info("profiler: the run resumed at step %d, past the window; no trace", step)
                return False
            # One warm-up step where there is one to spare (a run resumed just before the
            # window has none).
            warmup = min(before, 1)
            self.prof = profile(
                activities=self.activities, record_shapes=False, on_trace_ready=self.write,
                schedule=schedule(wait=before - warmup, warmup=warmup, active=self.steps,
                                  repeat=1),
            )
            self.prof.start()
        elif self.prof is not None:
            self.prof.step()
        return self.prof is not None and self.prof.current_action != ProfilerAction.NONE

    def write(self, prof: profile) -> None:
        """The window ended: its trace to `path`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self.written = True
        last = self.start_step + self.steps - 1
        log.info("profiler trace of steps %d-%d: %s", self.start_step, last, self.path)

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
