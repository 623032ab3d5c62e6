"""Step-time, throughput and memory figures, kept cheap enough to sit inside the training loop."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

#: Set by the launcher for its workers: the pid of the process the job's processes run under.
JOB_PID_ENV = "MGPU_JOB_PID"


class OtherLoad:
    """How much of this machine's CPU other processes used over a window: the machine's busy
    CPU time minus that of the job's own processes (the launcher and every process under it),
    as a fraction of all cores over the window's wall time. 0 on a quiet machine; 0.5 on a
    2-core machine means another process held one core throughout, and throughput figures of
    that window are not comparable with a quiet run's."""

    def __init__(self) -> None:
        root = int(os.environ.get(JOB_PID_ENV, os.getppid()))  # torchrun: its agent
        try:
            self.root = psutil.Process(root)
        except psutil.NoSuchProcess:
            self.root = psutil.Process()
        self.cores = psutil.cpu_count() or 1
        self.started: tuple[float, float, float] | None = None

    def job_cpu_s(self) -> float:
        """CPU seconds of the job's processes alive now (the launcher and those under it)."""
        total = 0.0
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:  # ended since it was listed
                continue
            total += times.user + times.system
        return total

    @staticmethod
    def busy_cpu_s() -> float:
        """CPU seconds every core spent busy since boot (guest time is within user time)."""
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        return sum(t) - idle - guest  # sum(t) counts guest twice: in user and on its own

    def start(self) -> None:
        self.started = (time.perf_counter(), self.busy_cpu_s(), self.job_cpu_s())

    def fraction(self) -> float | None:
        """Other processes' share of the machine since `start` (None before it)."""
        if self.started is None:
            return None
        wall, busy, own = self.started
        wall = time.perf_counter() - wall
        other = (self.busy_cpu_s() - busy) - (self.job_cpu_s() - own)
        return max(0.0, other / (wall * self.cores)) if wall > 0 else None


@dataclass
class Stall:
    """Time the loop spent outside training steps (a log point, an evaluation, a checkpoint)."""

    seconds: float = 0.0


class StepMeter:
    """Records each step's wall time and loss; turns them into metrics at log points.

    Step times run from the end of one step to the end of the next, so everything the loop
    does per step counts, and on CUDA the device work a step queues is paid for by a later
    step (the host runs ahead until something waits for the device). Stalls that are not
    training — log points, evaluation, checkpoints — run inside `stall()`, which first waits
    for the device (the last step's queued work belongs to that step) and then leaves the
    stall out of every step figure. Losses stay on the device until a log point, so recording
    adds no device synchronisation.

    Warm-up is the first `warmup_steps` steps this meter records, whatever their global step
    numbers: a run resumed from a checkpoint starts cold again (allocator, caches, the
    process group's first collectives), so its first steps warm up as a fresh run's do.
    """

    def __init__(
        self, global_batch: int, warmup_steps: int, device: torch.device,
        other_load: OtherLoad | None = None,
    ) -> None:
        """`other_load`, where given, is measured over the steps timed after warm-up."""
        self.other_load = other_load
        if other_load and warmup_steps == 0:
            other_load.start()
        self.global_batch = global_batch
        self.warmup_steps = warmup_steps
        self.device = device
        self.durations: list[float] = []  # steps after warm-up
        self.window_losses: list[torch.Tensor] = []  # per step: this rank's loss x samples
        self.window_samples = 0  # this rank's samples in those steps
        self.window_s = 0.0  # every step since the last log point, warm-up included
        self.window_steps = 0
        self.last = time.perf_counter()
        self.last_measured = False  # whether the last recorded step is one of `durations`
        self.first_step: int | None = None  # the first step this process ran

    def record(self, step: int, loss_sum: torch.Tensor, samples: int) -> None:
        """Step `step` ended; `loss_sum` is this rank's loss summed over its `samples` samples."""
        now = time.perf_counter()
        if self.first_step is None:
            self.first_step = step
        ran = step - self.first_step + 1  # steps of this process (since start or resume)
        self._add(now - self.last, measured=ran > self.warmup_steps)
        self.last = now
        if ran == self.warmup_steps and self.other_load:
            self.other_load.start()
        self.window_losses.append(loss_sum)
        self.window_samples += samples

    def _add(self, seconds: float, measured: bool) -> None:
        if measured:
            self.durations.append(seconds)
        self.window_s += seconds
        self.window_steps += 1
        self.last_measured = measured

    @contextmanager
    def stall(self) -> Iterator[Stall]:
        """Run a stall outside the step figures; its length is in the yielded `Stall`."""
        synchronize(self.device)
        start = time.perf_counter()
        tail = start - self.last  # the last step's device work still queued, and bookkeeping
        if self.last_measured:
            self.durations[-1] += tail
        self.window_s += tail
        self.last = start
        stall = Stall()
        try:
            yield stall
        finally:
            self.last = time.perf_counter()
            stall.seconds = self.last - start

    def window_loss(self) -> float:
        """Mean loss per sample over all ranks and the steps since the last call.

        Each rank's loss is weighted by its samples, so uneven splits give the global-batch
        mean. Ranks that share one data replica (tensor or pipeline peers) report the same
        loss and samples; every replica has the same number of them, so they weigh evenly.
        One small all-reduce.
        """
        total = torch.stack(self.window_losses).sum().double()
        pair = torch.stack([total, total.new_tensor(float(self.window_samples))])
        if dist.is_initialized():
            dist.all_reduce(pair)
        self.window_losses.clear()
        self.window_samples = 0
        total, samples = pair.tolist()
        return total / samples

    def window_step_s(self) -> float | None:
        """Mean step time since the last call (warm-up steps included), stalls left out."""
        mean = self.window_s / self.window_steps if self.window_steps else None
        self.window_s, self.window_steps = 0.0, 0
        return mean

    def throughput(self) -> dict[str, float]:
        """Global samples/s and step-time percentiles over the steps timed so far."""
        if not self.durations:
            return {}
        p50, p90, p99 = np.percentile(self.durations, [50, 90, 99])
        figures = {
            "train/samples_per_s": self.global_batch * len(self.durations) / sum(self.durations),
            "time/step_p50_s": float(p50),
            "time/step_p90_s": float(p90),
            "time/step_p99_s": float(p99),
        }
        other = self.other_load.fraction() if self.other_load else None
        if other is not None:
            figures["host/other_cpu_fraction"] = other
        return figures


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The highest peak of any rank: allocated device memory on CUDA, the process's resident
    set on CPU. Ranks peak differently (a pipeline's last stage holds the head and the loss),
    so one rank's own peak would not say whether the job fits; every rank must call it (one
    small all-reduce, at log points, where every rank already meets)."""
    peak = local_peak_bytes(device)
    if not dist.is_initialized():
        return peak
    highest = torch.tensor(peak, dtype=torch.int64)  # CPU: every process group has gloo for it
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    return int(highest)


def local_peak_bytes(device: torch.device) -> int:
    """This rank's own peak: allocated device memory on CUDA, the process's resident set on
    CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank actually holds for `tensor` (its shard, for a DTensor)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds; ZeroRedundancyOptimizer keeps this rank's
    shard of the state in its inner optimizer."""
    inner = getattr(optimizer, "optim", optimizer)
    return sum(
        local_bytes(value)
        for state in inner.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def memory_metrics(
    params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer
) -> dict[str, float]:
    """Parameter and optimizer-state bytes held by one rank, the largest over all ranks: what
    sharding saves shows on the rank that saves least."""
    held = torch.tensor(
        [sum(local_bytes(p) for p in params), optimizer_state_bytes(optimizer)],
        dtype=torch.float64,
    )
    if dist.is_initialized():
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return {
        "memory/param_bytes_per_rank": held[0].item(),
        "memory/optimizer_bytes_per_rank": held[1].item(),
    }
