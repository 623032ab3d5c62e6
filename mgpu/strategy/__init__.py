"""Parallel strategies: how the model is placed on ranks and how its gradients are synchronised.

Options subclass `Strategy` explicitly to inherit the defaults below, which fit any strategy
whose every rank runs the whole forward and backward pass (single, ddp, zero1, fsdp, tp);
pipeline parallelism overrides the step, the prediction and the gathering of weights.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from mgpu.parallel import memory_metrics
from mgpu.precision.padding import unpad_state_dict
from mgpu.runtime import Runtime

if TYPE_CHECKING:
    from mgpu.config import Job

#: Optimizer state in DCP's flat layout, every entry keyed by parameter name
#: (`state.<name>.exp_avg`, `param_groups.<name>.lr`): ranks holding different parameters
#: (pipeline stages, ZeRO partitions) write disjoint keys, and a run split another way loads
#: its own parameters' entries. The nested layout keeps param groups as lists per rank, which
#: collide across ranks that hold different parameters.
BY_PARAMETER_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


class Strategy(Protocol):
    """What a strategy declares (plain class attributes, or properties where its settings
    decide), read by the cross-group rules in `mgpu.support` and the support matrix."""

    #: Number of processes the strategy requires, or None for any.
    world_size: int | None
    #: Every rank holds every parameter whole, so all ranks' gradients agree after the step.
    replicates_params: bool
    #: Gradients travel through DDP, so a compression's or a balance's comm hook can carry them.
    supports_comm_hook: bool
    #: Each rank keeps the optimizer state of its own share of the parameters only.
    shards_optimizer: bool
    #: The model is cut into pipeline stages whose schedule runs forward and backward itself.
    pipelined: bool
    #: Ranks may take unequal shares of the global batch, and a rank's forward and backward
    #: hold no collective, so its step time is its own work (what balance options split by).
    uneven_batches: bool
    #: Model methods the strategy splits the model with (`mgpu.support.MODEL_PLANS`).
    model_plans: tuple[str, ...]

    def validate(self, job: Job) -> None:
        """Raise ConfigError for settings this strategy cannot run with (parent, before launch)."""

    def wrap(
        self, model: nn.Module, rt: Runtime, network: object, precision: object
    ) -> nn.Module:
        """Return the model placed on `rt.device` and ready for parallel training."""

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Context for micro-batches whose gradients are only accumulated, not synchronised."""

    def data_runtime(self, rt: Runtime) -> Runtime:
        """`rt` as the data loaders should see it: rank and size within the data-parallel group
        (ranks that split one model between them must read the same samples)."""
        return rt

    def build_optimizer(
        self, optim: object, model: nn.Module, total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer over this rank's (local, possibly sharded) parameters."""
        return optim.build(model.parameters(), total_steps)

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """The optimizer's state for a DCP checkpoint, keyed by parameter name (a sharded
        optimizer's shards as DTensors); also the template a checkpoint loads into. Every rank
        calls it."""
        return get_optimizer_state_dict(model, optimizer, options=BY_PARAMETER_NAME)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Put the state `optimizer_state_dict`'s template was loaded with into the optimizer."""
        set_optimizer_state_dict(model, optimizer, state, options=BY_PARAMETER_NAME)

    def forward_backward(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, precision: object,
        divisor: float, timer: object,
    ) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; returns the detached loss.

        The loss is divided by `divisor`, the micro-batch's weight in the global batch
        (train.grad_accum on an equal split); `timer` times the phases (a no-op unless
        monitoring is on).
        """
        with timer.phase("forward"), precision.autocast(inputs.device):
            loss = F.cross_entropy(model(inputs), labels)
        with timer.phase("backward"):
            precision.backward(loss / divisor if divisor != 1 else loss)
        return loss.detach()

    def predict(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """Logits for `inputs` (evaluation, under no_grad)."""
        return model(inputs)

    def metrics(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Strategy figures at a log point: bytes of parameters and optimizer state per rank."""
        return memory_metrics(model.parameters(), optimizer)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU at the model's own sizes (tensor-core padding cut
        off), complete on rank 0; every rank must call it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return unpad_state_dict(get_model_state_dict(model, options=options), model)


def with_rank(rt: Runtime, rank: int, world_size: int) -> Runtime:
    return dataclasses.replace(rt, rank=rank, world_size=world_size)



