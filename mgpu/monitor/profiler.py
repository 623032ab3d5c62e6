"""torch.profiler over a window of steps, written as a Chrome trace (chrome://tracing, Perfetto).

Each rank writes `profile/trace_rank<r>.json` in the run's output directory and logs it to the
MLflow run under `profile/`. While it records, the step phases are labelled in the trace.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, device: torch.device, start_step: int, steps: int, out: Path) -> None:
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.start_step, self.last_step = start_step, start_step + steps - 1
        self.path = out
        self.prof: profile | None = None
        self.written = False

    def after_step(self, step: int) -> bool | None:
        """Start before the window's first step, stop after its last; True while recording."""
        if step == self.start_step - 1:
            self.prof = profile(activities=self.activities, record_shapes=False)
            self.prof.start()
            return True
        if step == self.last_step and self.prof is not None:
            self.prof.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.path))
            self.prof, self.written = None, True
            log.info("profiler trace of steps %d-%d: %s", self.start_step, step, self.path)
            return False
        return None
