"""Gradient compression: what a data-parallel strategy sends on the wire."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Compression(Protocol):
    """What a compression declares, read by `mgpu.support` and the support matrix."""

    #: It is a DDP comm hook: the strategy must take one (and nothing else may install one).
    needs_comm_hook: bool
    #: It keeps state from step to step (error feedback), saved in every checkpoint.
    stateful: bool
    #: Ranks apply exactly the averaged gradients (no rounding or approximation on the wire).
    exact: bool

    def register(self, model: nn.Module) -> None:
        """Install the compression on the wrapped model (a DDP comm hook, say)."""

    def begin_step(self, grad_scale: torch.Tensor | None) -> None:
        """Before the step's backward: the factor its gradients carry (the loss scale, a
        tensor on the device; None without loss scaling), so state is kept in unscaled units."""

    def end_step(self, applied: bool) -> None:
        """After the optimizer step; `applied` is False where it was skipped (non-finite), so
        state computed from the step's gradients is dropped, not kept."""

    def metrics(self) -> dict[str, float]:
        """`comm/*` figures since the last call (bytes per step, compression ratio), or {}."""

    def state_dict(self) -> dict:
        """Per-rank state (error-feedback residuals, ...) for checkpoints."""

    def load_state_dict(self, state: dict) -> None: ...
