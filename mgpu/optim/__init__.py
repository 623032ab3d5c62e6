"""Optimizers: each option builds a torch optimizer and its learning-rate schedule."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch


class Optim(Protocol):
    def build(
        self, params: Iterable[torch.nn.Parameter], total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]: ...
