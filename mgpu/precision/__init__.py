"""Precision: the dtype the forward pass computes in, and how gradients reach the optimizer."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn


class Precision(Protocol):
    #: dtype parameters compute in (FSDP's MixedPrecisionPolicy.param_dtype; the stored
    #: weights stay fp32), and dtype gradients are reduced in (for sharded strategies).
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    #: The loss is scaled before backward (and gradients unscaled before the step).
    loss_scaling: bool

    def prepare(self, model: nn.Module) -> nn.Module:
        """Before the strategy wraps the model: adapt it (tensor-core padding)."""

    def attach(self, model: nn.Module, device: torch.device) -> None:
        """After the strategy wrapped the model: set up device-side state (the loss scaler)."""

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Context the forward pass and loss run under."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaled where the precision needs it)."""

    def grad_scale(self) -> torch.Tensor | None:
        """The factor the next backward's gradients carry: the loss scale under amp (a tensor
        on the device, read without a host sync), None where the loss is not scaled."""

    def step(self, optimizer: torch.optim.Optimizer,
             grad_scale: torch.Tensor | None = None) -> bool:
        """Apply the optimizer step; return False where the step was skipped (non-finite).
        `grad_scale`: the loss scale the gradients carry, where it is not the current one
        (gradients computed some steps before, under another scale)."""

    def metrics(self) -> dict[str, float]:
        """Merged into each metric point: `train/skipped_steps`, and `amp/loss_scale` where the
        precision scales the loss."""

    def state_dict(self) -> dict[str, Any]:
        """Loss scaler and skip counters, for checkpoints."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
