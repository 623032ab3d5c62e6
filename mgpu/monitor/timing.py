"""Per-phase step timing: data, forward, backward, optimizer — without syncing the device.

On CPU a mark is `time.perf_counter()`. On CUDA it is a timing event recorded on the current
stream, so a phase's duration is the device's own time between its marks; the events are read
at log points, after the loss has been fetched (which has already waited for the device).
The same marks (`clock_for`) time the comm hook, pipeline stages and the balance step clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

PHASES = ("data", "forward", "backward", "optimizer")


class WallClock:
    """Marks on the host: what the host spends is what the device spends (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """Marks on the current CUDA stream: the device's own time, read without syncing it when
    recorded (the host runs ahead)."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # waits only where the device is behind (at log points it is not)
        return start.elapsed_time(end) / 1000


def clock_for(device: torch.device) -> WallClock | CudaClock:
    """The marks for `device`: every timer in mgpu stamps with these, so figures agree."""
    return CudaClock() if device.type == "cuda" else WallClock()


def in_flight_s(intervals: list[tuple[Any, Any]], seconds: Callable[[Any, Any], float]) -> float:
    """Wall time during which at least one of `intervals` ((start, end) marks, `seconds`
    between two marks) was in flight: the length of their union.

    A step's gradient buckets are launched as backward goes and run one after another on the
    process group, so each bucket's launch-to-completion interval includes its wait behind the
    earlier ones: added up, they count the same wall time several times over.
    """
    if not intervals:
        return 0.0
    origin = intervals[0][0]  # marks compare only through `seconds` (CUDA events)
    spans = sorted((seconds(origin, start), seconds(origin, end)) for start, end in intervals)
    total = 0.0
    first, last = spans[0]
    for start, end in spans[1:]:
        if start > last:  # a gap: close the union's current piece
            total += last - first
            first = start
        last = max(last, end)
    return total + last - first


class NullTimer:
    """The timer when monitoring is off: every phase is the same do-nothing context."""

    _null = nullcontext()

    def phase(self, name: str) -> nullcontext:
        return self._null


class Phase:
    """One phase of a step: marks at entry and exit, an NVTX range on CUDA, a profiler label
    while torch.profiler records. A plain class, one instance per phase name, reused every
    step: cheaper than a generator context (phases of one name never nest)."""

    __slots__ = ("timer", "name", "start", "label")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        timer = self.timer
        self.start = timer.clock.mark()
        if timer.step_start is None:
            timer.step_start = self.start
        if timer.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        self.label = torch.profiler.record_function(self.name) if timer.annotate else None
        if self.label:
            self.label.__enter__()

    def __exit__(self, *exc: object) -> None:
        timer = self.timer
        if self.label:
            self.label.__exit__(*exc)
        if timer.nvtx:
            torch.cuda.nvtx.range_pop()
        timer.marks.append((self.name, self.start, timer.clock.mark()))


class PhaseTimer:
    """Marks the phases of each step; turns them into seconds at log points.

    `comm` (a `CommMeter`, or None) reports when this step's first collective was launched,
    which gives each rank's compute before communication: the figure that names stragglers.
    The percentiles leave out the first `warmup_steps` steps this process ran, counted from
    its first step (a resumed run warms up again), as `mgpu.meter.StepMeter` does.
    """

    def __init__(self, device: torch.device, warmup_steps: int, comm: Any = None) -> None:
        self.clock = clock_for(device)
        self.nvtx = device.type == "cuda"
        self.annotate = False  # set while torch.profiler records, to label its trace
        self.warmup_steps = warmup_steps
        self.comm = comm
        self.first_step: int | None = None  # the first step this process ran
        self.step_start: Any = None
        self.marks: list[tuple[str, Any, Any]] = []
        self.pending: list[tuple[int, Any, list, Any, list]] = []
        self.run = np.empty((1024, len(PHASES)))  # a row per step after warm-up, for pXX
        self.run_steps = 0
        self.window: list[dict[str, float]] = []  # every step since the last log point
        self.phases: dict[str, Phase] = {}

    def phase(self, name: str) -> Phase:
        if name not in self.phases:
            self.phases[name] = Phase(self, name)
        return self.phases[name]

    def end_step(self, step: int) -> None:
        """Close the step's marks (no device work: they are read at the next log point)."""
        if self.first_step is None:
            self.first_step = step
        first_comm, collectives = self.comm.take_step() if self.comm else (None, [])
        self.pending.append((step, self.step_start, self.marks, first_comm, collectives))
        self.step_start, self.marks = None, []

    def collect(self) -> list[dict[str, float]]:
        """Seconds per phase of every step since the last call (also kept for percentiles)."""
        seconds = self.clock.seconds
        for step, step_start, marks, first_comm, collectives in self.pending:
            times = dict.fromkeys(PHASES, 0.0)
            for name, start, end in marks:
                times[name] = times.get(name, 0.0) + seconds(start, end)
            # No collective seen (one process, or a strategy without a DDP comm hook): no
            # moment at which compute ended and communication began.
            times["compute_before_comm"] = (
                seconds(step_start, first_comm) if first_comm is not None else math.nan
            )
            times["allreduce"] = in_flight_s(collectives, seconds)
            if step - self.first_step >= self.warmup_steps:
                if self.run_steps == len(self.run):
                    self.run = np.concatenate([self.run, np.empty_like(self.run)])
                self.run[self.run_steps] = [times[name] for name in PHASES]
                self.run_steps += 1
            self.window.append(times)
        self.pending.clear()
        window, self.window = self.window, []
        return window

    def percentiles(self) -> dict[str, float]:
        """p50/p90/p99 and the mean of each phase over the steps after warm-up."""
        if not self.run_steps:
            return {}
        run = self.run[: self.run_steps]
        p50, p90, p99 = np.percentile(run, [50, 90, 99], axis=0)
        mean = run.mean(axis=0)
        metrics = {}
        for i, name in enumerate(PHASES):
            metrics.update({
                f"time/{name}_p50_s": float(p50[i]),
                f"time/{name}_p90_s": float(p90[i]),
                f"time/{name}_p99_s": float(p99[i]),
                f"time/{name}_mean_s": float(mean[i]),
            })
        return metrics
