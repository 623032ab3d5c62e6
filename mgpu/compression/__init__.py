"""Gradient compression: what a data-parallel strategy sends on the wire."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

#: What DDP's `register_comm_hook(state, hook)` takes: the hook's state and the hook. An option
#: that owns the comm hook hands this over and `Trainer.build` registers it, so one place installs
#: DDP's one hook and the monitor can time it there.
CommHook = tuple[Any, Callable[[Any, dist.GradBucket], torch.futures.Future]]


class Compression(Protocol):
    """What a compression declares, read by `mgpu.support` and the support matrix."""

    #: It is a DDP comm hook: the strategy must take one (and nothing else may install one).
    needs_comm_hook: bool
    #: It keeps state from step to step (error feedback), saved in every checkpoint.
    stateful: bool
    #: Ranks apply exactly the averaged gradients (no rounding or approximation on the wire).
    exact: bool
    #: Where the compression is only a dtype on the wire: that dtype (a sharded layout reduces
    #: gradients in it itself, without a comm hook); None otherwise.
    wire_dtype: torch.dtype | None
    #: Its exchanges of consecutive steps may be in flight at once, each applied steps after
    #: its hook ran (balance=ssp): each takes its state when its hook runs, and keeps what it
    #: learned once its result is applied (`applied_after`).
    overlaps_steps: bool

    def comm_hook(self, model: nn.Module) -> CommHook | None:
        """Set up for the wrapped model; return the DDP comm hook that sends its gradients,
        or None where DDP's built-in all-reduce does (`Trainer.build` registers it)."""

    def applied_after(self, steps: int) -> None:
        """Where a balance runs this compression's hook (ssp): each step's exchange is applied
        `steps` steps after its hook ran, so `end_step` keeps what it learned then."""

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
