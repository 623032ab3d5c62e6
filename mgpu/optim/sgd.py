"""SGD with momentum, fused by default like AdamW (one kernel for every parameter)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mgpu.errors import ConfigError
from mgpu.optim import fused_if_plain
from mgpu.optim.schedule import check_schedule, lr_schedule


class SGD:
    def __init__(
        self,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        schedule: str = "cosine",
        warmup_steps: int = 0,
        fused: bool = True,
    ) -> None:
        if lr <= 0:
            raise ConfigError(f"optim.lr={lr}: must be > 0")
        if not 0 <= momentum < 1:
            raise ConfigError(f"optim.momentum={momentum}: must be in [0, 1)")
        check_schedule(schedule, warmup_steps)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.schedule, self.warmup_steps = schedule, warmup_steps
        self.fused = fused

    def build(self, params: Iterable[torch.nn.Parameter], total_steps: int):
        params = list(params)
        optimizer = torch.optim.SGD(
            params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
            fused=fused_if_plain(params, self.fused),
        )
        return optimizer, lr_schedule(optimizer, self.schedule, self.warmup_steps, total_steps)
