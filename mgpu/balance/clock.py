"""Per-step timing on one rank, split into the rank's own work and its wait for the others.

Under DDP a rank's gradients are all-reduced at the end of the backward pass, so a fast rank's
wall-clock step time equals the slowest rank's: it says nothing about its own speed. The clock
therefore stamps three moments of each step:

- start: `start_step()`, before the first forward;
- ready: the last local gradient accumulated (a post-accumulate-grad hook on every parameter)
  — the rank's own work, forward + backward (+ any simulated straggler delay), ends here;
- end: `end_backward()`, after the backward pass returned, i.e. after DDP waited for the peers.

busy = ready - start is what the rank would take alone; wait = end - ready is time lost to
slower peers (`time/sync_wait_s`). Under FSDP2 every block's forward and backward gathers its
parameters from all ranks (and its backward reduce-scatters the gradients), so a fast rank
waits for a slow one inside them: there the time in those collectives (their calls, timed where
they are counted: `mgpu.parallel.fsdp.WireCount`) up to `ready` moves from busy to wait, and
busy is again the rank's own work. A simulated straggler sleeps at the start of the backward
pass (a hook on the model's output), before any gradient is sent, so its delay is part of its
own busy time and not of its peers' (a sleep before the forward would be, where the forward
synchronises buffers). Under a pipeline (strategy=pp, hybrid pp > 1) the model is the list of
this rank's stages, which the schedule never calls as a whole: there the straggler waits (f - 1)
times each stage's forward or backward of a micro-batch right after it (`Stages.after_compute`),
so a slow stage holds up every micro-batch as a slow device would (on CUDA each such delay
first waits for the stage's kernels: a simulation's cost, on the straggler's rank only).

The delay is waited out to the microsecond (`wait`): `time.sleep` oversleeps by ~80 us on the
2-core CPU machine whatever the delay (measured from 10 us to 3 ms), a cost that does not scale
with the batch added to every straggler step: at the default job's ~0.5 ms of compute, 16 %
more than the slowdown asks for. The stamps are those of the monitor's phase timer
(`mgpu.monitor.timing.clock_for`): perf_counter on CPU, CUDA events on GPU, resolved here at
the start of the next step, which lets the host run ahead of the device by at most one step.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from mgpu.monitor.timing import clock_for, in_flight_s
from mgpu.parallel.fsdp import count_collectives
from mgpu.pipeline import Stages
from mgpu.straggler import Straggler

#: `wait` sleeps until this long before its deadline and spins the rest: more than time.sleep's
#: usual oversleep (~80 us measured, up to ~150 us at the 90th percentile on a loaded machine).
SPIN_S = 2e-4


def wait(seconds: float) -> float:
    """Let `seconds` pass on this thread, to the microsecond; returns the seconds it took.

    Sleeps for all but the last SPIN_S, then spins on perf_counter to the deadline: the spin
    keeps the core busy for at most SPIN_S, as the compute it stands for would.
    """
    started = time.perf_counter()
    deadline = started + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < deadline:
        pass
    return time.perf_counter() - started


class StepClock:
    def __init__(self, straggler: Straggler, device: torch.device) -> None:
        self.straggler = straggler
        self.clock = clock_for(device)  # the stamps the monitor's phase timer takes too
        self.cuda = device.type == "cuda"  # events are read a step late, not at once
        self.compute_s = 0.0  # last step's compute (busy minus straggler delay): the delay's basis
        # (start, ready, end, slept, samples, collective spans up to ready) of the last step
        self.pending: tuple | None = None
        self.start = self.ready = None
        self.collectives = None  # FSDP2's collectives, timed (a WireCount), once attached
        self.ready_calls = 0  # collective calls made up to the last gradient-ready stamp
        self.slept, self.delayed, self.samples = 0.0, False, 0
        # Running sums since the start; readers keep their own last copy and take differences.
        self.sums = {"steps": 0, "samples": 0, "busy_s": 0.0, "wait_s": 0.0}
        self.busy_s: list[float] = []  # every resolved step's busy seconds
        # A pipeline's stage computes (micro-batch forwards, backwards, a zero-bubble schedule's
        # weight gradients) followed by a delay.
        self.stage_delays = {"forward": 0, "backward": 0, "weight": 0}

    def attach(self, model: nn.Module) -> None:
        """Install the hooks: output → straggler delay (a pipeline's stages: each stage's
        compute → its delay and, after a backward, a gradient-ready stamp); every parameter →
        gradient-ready stamp; FSDP2's collectives → timed, as time that is not the rank's own."""
        if isinstance(model, Stages):
            model.after_compute.append(self._on_stage_compute)
        else:
            inner = getattr(model, "module", model)  # DDP's forward hooks: on the inner module
            inner.register_forward_hook(self._on_forward)
            self.collectives = count_collectives(model)  # FSDP2's, where the model has them
            if self.collectives:
                self.collectives.marks = self.clock
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def start_step(self, samples: int) -> None:
        """A step over `samples` samples (this rank's share) begins."""
        self._resolve()
        if self.collectives:  # those since the last step's ready stamp (evaluation's) are no step's
            self.collectives.spans = []
        self.ready_calls = 0
        self.start, self.slept, self.delayed, self.samples = self.clock.mark(), 0.0, False, samples

    def end_backward(self) -> None:
        spans = self.collectives.spans[: self.ready_calls] if self.collectives else []
        self.pending = (self.start, self.ready, self.clock.mark(), self.slept, self.samples, spans)
        if not self.cuda:
            self._resolve()

    def totals(self) -> dict[str, float]:
        """Steps, samples, busy seconds and wait seconds since the start, in that order."""
        self._resolve()
        return dict(self.sums)

    def _on_forward(self, module: nn.Module, inputs: object, output: object) -> None:
        if self.straggler.active and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if not self.delayed:  # once per step, on the first micro-batch's backward
            self.delayed = True
            delay = self.straggler.delay_s(self.compute_s)
            if delay > 0:
                self.slept += wait(delay)  # what it took, to the last microsecond: no compute

    def _on_stage_compute(self, kind: str, start: object, end: object) -> None:
        """A pipeline stage's forward or backward of one micro-batch took start → end: wait
        (f - 1) times as long, the step's jitter with the first of them. A backward's end is a
        gradient-ready stamp too: a zero-bubble schedule's weight pass sets the gradients
        itself (autograd.grad), which fires no post-accumulate-grad hook."""
        if kind != "forward":
            self.ready = end
        if not self.straggler.active:
            return
        seconds = self.clock.seconds(start, end)  # on CUDA: waits for the stage's kernels
        if self.delayed:
            delay = (self.straggler.factor - 1.0) * seconds
        else:
            self.delayed = True
            delay = self.straggler.delay_s(seconds)
        if delay > 0:
            self.slept += wait(delay)
            self.stage_delays[kind] += 1

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self.ready = self.clock.mark()
        if self.collectives:
            self.ready_calls = len(self.collectives.spans)

    def _resolve(self) -> None:
        """Turn the last step's stamps into its busy and wait times."""
        if self.pending is None:
            return
        start, ready, end, slept, samples, before = self.pending
        self.pending = None
        waited = in_flight_s(before, self.clock.seconds)  # in FSDP2's collectives
        busy = self.clock.seconds(start, ready) - waited
        self.compute_s = max(0.0, busy - slept)
        self.sums["steps"] += 1
        self.sums["samples"] += samples
        self.sums["busy_s"] += busy
        self.busy_s.append(busy)
        self.sums["wait_s"] += self.clock.seconds(ready, end) + waited
