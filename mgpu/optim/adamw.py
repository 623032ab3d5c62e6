"""AdamW with decoupled weight decay, fused by default: one kernel updates every parameter (on
CPU and CUDA), where torch's default loops over them in Python. Sharded and tensor-parallel
parameters (DTensors) keep torch's loop: fused kernels have no rules for them."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mgpu.errors import ConfigError
from mgpu.optim import fused_if_plain
from mgpu.optim.schedule import check_schedule, lr_schedule


class AdamW:
    def __init__(
        self,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        betas: list[float] = (0.9, 0.999),
        schedule: str = "cosine",
        warmup_steps: int = 0,
        fused: bool = True,
    ) -> None:
        if lr <= 0:
            raise ConfigError(f"optim.lr={lr}: must be > 0")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"optim.betas={list(betas)}: use two values in [0, 1)")
        check_schedule(schedule, warmup_steps)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.schedule, self.warmup_steps = schedule, warmup_steps
        self.fused = fused

    def build(self, params: Iterable[torch.nn.Parameter], total_steps: int):
        params = list(params)
        optimizer = torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay,
            fused=fused_if_plain(params, self.fused),
        )
        return optimizer, lr_schedule(optimizer, self.schedule, self.warmup_steps, total_steps)
