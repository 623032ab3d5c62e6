"""Fault injection for tests and demos: fail one rank at one step, on the first attempt only.

`nonfinite_grad` fails nothing: it puts an inf into one gradient, which the precision skips.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn


def fault_step(fault: dict, rank: int) -> int | None:
    """The step at which this rank fails, or None. Restarted attempts run clean."""
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    if fault["mode"] and rank == fault["kill_rank"] and first_attempt:
        return fault["at_step"]
    return None


def inject(mode: str, rank: int, step: int, model: nn.Module | None = None) -> None:
    if mode == "nonfinite_grad":
        poison_next_gradient(model)
        return
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault (fault.mode={mode}) on rank {rank} at step {step}")


def poison_next_gradient(model: nn.Module) -> None:
    """Make the next gradient of the model's first parameter +inf on this rank, once.

    A tensor hook runs as the gradient is computed, before DDP's all-reduce sees it: the same
    place a real overflow would appear.
    """
    param = next(model.parameters())

    def to_inf(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        return torch.full_like(grad, float("inf"))

    handle = param.register_hook(to_inf)
