"""Learning-rate schedules shared by the optimizer options."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from mgpu.errors import ConfigError

SCHEDULES = ("constant", "cosine")


def check_schedule(schedule: str, warmup_steps: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={schedule}: use one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={warmup_steps}: must be >= 0")


def lr_schedule(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int
) -> LambdaLR:
    """Linear warm-up over `warmup_steps`, then constant or cosine decay to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return LambdaLR(optimizer, factor)
