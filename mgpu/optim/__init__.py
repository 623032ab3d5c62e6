"""Optimizers: each option builds a torch optimizer and its learning-rate schedule."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor


class Optim(Protocol):
    def build(
        self, params: Iterable[torch.nn.Parameter], total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]: ...


def fused_if_plain(params: list[torch.nn.Parameter], fused: bool) -> bool | None:
    """torch's `fused` argument: True where asked for and every parameter is a plain tensor;
    else None (torch's own choice). Fused kernels have no DTensor rules (sharded and
    tensor-parallel parameters), so those keep torch's per-tensor loop."""
    if fused and not any(isinstance(p, DTensor) for p in params):
        return True
    return None
