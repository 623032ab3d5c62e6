"""What every precision shares: tensor-core padding and the non-finite step guard.

A step whose loss or gradients are not finite is skipped, not applied: one bad batch must not
turn the weights into NaN. The decision has to be the same on every rank, or data-parallel
replicas drift apart. Two things make it so without an extra collective under DDP:
- backward starts from a gradient of 1 for a finite loss and NaN for a non-finite one
  (`loss_seed`), so every non-finite value is in the gradients before they are synchronised;
- DDP's all-reduce then carries any inf/NaN to every rank, and each rank's check of its
  (identical) gradients gives the same answer.
Where ranks hold different gradients after backward (a wrapper other than DDP on several ranks:
sharded or pipelined models), the flag itself is all-reduced, one float per step.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from mgpu.errors import ConfigError
from mgpu.precision.padding import pad_linear_layers

log = logging.getLogger("mgpu.precision")


class NonFiniteSteps(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


def loss_seed(loss: torch.Tensor) -> torch.Tensor:
    """The gradient backward starts from: 1 for a finite loss, NaN for inf/NaN (x - x is 0,
    and exp(0) = 1, exactly when x is finite). Two element-wise ops and no host sync: cheaper
    than isfinite + where in the graph, which cost a measurable share of a small model's step."""
    value = loss.detach()
    return (value - value).exp_()


def nonfinite_grads(
    optimizer: torch.optim.Optimizer, device: torch.device, inv_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """1.0 if any gradient holds inf/NaN, else 0.0, as a tensor on `device` (no host sync);
    with `inv_scale`, every gradient is also multiplied by it (a loss scale taken back out).

    Uses the fused check GradScaler itself uses, on the part of each gradient this rank holds
    (a DTensor's local shard: sharded strategies all-reduce the flag).
    """
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return nonfinite_in(params, device, inv_scale)


def nonfinite_in(
    params: Iterable[torch.Tensor], device: torch.device, inv_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`nonfinite_grads` of the gradients of `params`."""
    found = torch.zeros(1, device=device)
    by_device_dtype: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.to_local()
        if grad is not None:
            by_device_dtype[grad.device, grad.dtype].append(grad)
    for (grad_device, _), grads in by_device_dtype.items():
        flag = found if grad_device == found.device else torch.zeros_like(found, device=grad_device)
        scale = inv_scale if inv_scale is not None else torch.ones((), device=grad_device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, scale.to(grad_device))
        if flag is not found:
            found += flag.to(found.device)
    return found


class PrecisionBase:
    """Padding and the non-finite guard; subclasses choose autocast and the loss scaling."""

    param_dtype = torch.float32
    reduce_dtype = torch.float32
    loss_scaling = False

    def __init__(self, pad_to_multiple_of: int = 1, max_nonfinite_steps: int = 20) -> None:
        if pad_to_multiple_of < 1:
            raise ConfigError(
                f"precision.pad_to_multiple_of={pad_to_multiple_of}: must be >= 1 "
                "(1 = no padding, 8 for tensor cores)"
            )
        if max_nonfinite_steps < 1:
            raise ConfigError(
                f"precision.max_nonfinite_steps={max_nonfinite_steps}: must be >= 1"
            )
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_nonfinite_steps = max_nonfinite_steps
        self.device = torch.device("cpu")
        self.sync_flag = False  # all-reduce the non-finite flag (see the module docstring)
        self.steps = 0  # optimizer steps seen, skipped or not
        self.skipped_steps = 0
        self.consecutive_skips = 0

    def prepare(self, model: nn.Module) -> nn.Module:
        """Before the strategy wraps the model: pad its Linear layers."""
        return pad_linear_layers(model, self.pad_to_multiple_of)

    def attach(self, model: nn.Module, device: torch.device) -> None:
        """After the strategy wrapped the model: learn the device and whether ranks may differ."""
        self.device = device
        several_ranks = dist.is_initialized() and dist.get_world_size() > 1
        # A no-flush pipeline agrees on the flag itself, off its critical path (mgpu.twobw).
        agreed = getattr(model, "agrees_nonfinite", False)
        self.sync_flag = several_ranks and not isinstance(model, DistributedDataParallel) \
            and not agreed

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward(loss_seed(loss))

    def grad_scale(self) -> torch.Tensor | None:
        return None

    def step(self, optimizer: torch.optim.Optimizer,
             grad_scale: torch.Tensor | None = None) -> bool:
        found = nonfinite_grads(optimizer, self.device)
        if self.sync_flag:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        skipped = bool(found.item())
        if not skipped:
            optimizer.step()
        self.count(skipped)
        return not skipped

    def count(self, skipped: bool) -> None:
        """Count the step; raise once `max_nonfinite_steps` steps in a row were skipped."""
        self.steps += 1
        if not skipped:
            self.consecutive_skips = 0
            return
        self.skipped_steps += 1
        self.consecutive_skips += 1
        log.warning("step %d: non-finite loss or gradient, optimizer step skipped", self.steps)
        if self.consecutive_skips >= self.max_nonfinite_steps:
            raise NonFiniteSteps(
                f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or "
                f"gradient, the last at step {self.steps} (precision.max_nonfinite_steps="
                f"{self.max_nonfinite_steps}); lower optim.lr or check the data"
            )

    def metrics(self) -> dict[str, float]:
        """Optimizer steps skipped for a non-finite loss or gradient, since the start."""
        return {"train/skipped_steps": float(self.skipped_steps)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state["consecutive_skips"]
