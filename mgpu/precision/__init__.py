"""Precision: the dtype the forward pass computes in, and how gradients reach the optimizer."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch


class Precision(Protocol):
    #: dtype parameters are stored in, and dtype gradients are reduced in (for sharded strategies).
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Context the forward pass and loss run under."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaled where the precision needs it)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the optimizer step; return False where the step was skipped."""

    def state_dict(self) -> dict:
        """Loss-scaler state (scale, growth tracker) for checkpoints; {} where there is none."""

    def load_state_dict(self, state: dict) -> None: ...
