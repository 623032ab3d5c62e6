"""Step-time and throughput figures, kept cheap enough to sit inside the training loop."""

from __future__ import annotations

import resource
import sys
import time

import numpy as np
import torch
import torch.distributed as dist


class StepMeter:
    """Records each step's wall time and loss; turns them into metrics at log points.

    Losses stay on the device until a log point, so recording adds no device synchronisation.
    """

    def __init__(self, global_batch: int, warmup_steps: int) -> None:
        self.global_batch = global_batch
        self.warmup_steps = warmup_steps
        self.durations: list[float] = []  # steps after warm-up
        self.window_losses: list[torch.Tensor] = []
        self.last = time.perf_counter()
        self.measured_from: float | None = None
        self.steps_measured = 0

    def record(self, step: int, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        if step > self.warmup_steps:
            self.durations.append(now - self.last)
            self.steps_measured += 1
            if self.measured_from is None:
                self.measured_from = self.last
        self.last = now
        self.window_losses.append(loss)

    def window_loss(self) -> float:
        """Mean loss over all ranks and the steps since the last call (one small all-reduce)."""
        total = torch.stack(self.window_losses).sum()
        count = torch.tensor(float(len(self.window_losses)), device=total.device)
        pair = torch.stack([total.float(), count])
        if dist.is_initialized():
            dist.all_reduce(pair)
        self.window_losses.clear()
        return (pair[0] / pair[1]).item()

    def throughput(self) -> dict[str, float]:
        """Global samples/s and step-time percentiles over the steps after warm-up."""
        if not self.durations:
            return {}
        p50, p90, p99 = np.percentile(self.durations, [50, 90, 99])
        elapsed = self.last - self.measured_from
        return {
            "train/samples_per_s": self.global_batch * self.steps_measured / elapsed,
            "time/step_p50_s": float(p50),
            "time/step_p90_s": float(p90),
            "time/step_p99_s": float(p99),
        }


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
