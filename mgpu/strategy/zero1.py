"""ZeRO stage 1: DDP for gradients, optimizer state sharded over ranks (ZeroRedundancyOptimizer).

Each rank steps only its partition of the parameters and broadcasts the result, so optimizer
state per rank is about 1/world of DDP's while parameters and gradients stay whole.

Checkpoints hold each rank's partition by parameter name (`BY_PARAMETER_NAME`): the ranks'
keys are disjoint, so every rank writes its own and none gathers the whole state, and a run at
another world size loads its new partition's keys, whichever rank wrote them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.lr_scheduler import LambdaLR

from mgpu.strategy import BY_PARAMETER_NAME, load_keeping_kernels
from mgpu.strategy.ddp import DDP


class Zero1(DDP):
    shards_optimizer = True  # the rest as DDP: gradients still travel through its comm hook

    def build_optimizer(
        self, optim: object, model: nn.Module, total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        # The option's own optimizer tells the class and settings; ZeRO builds one like it over
        # this rank's partition, and the schedule is rebuilt to drive ZeRO's learning rate.
        reference, schedule = optim.build(model.parameters(), total_steps)
        accepted = inspect.signature(type(reference)).parameters
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=type(reference),
            **{k: v for k, v in reference.defaults.items() if k in accepted},
        )
        return zero, LambdaLR(zero, schedule.lr_lambdas)

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """This rank's partition: the optimizer ZeRO steps it with, by parameter name.

        (DCP cannot read ZeRO itself: its `state_dict` needs the whole state gathered first.)
        ZeRO copies its own groups' settings, the scheduled learning rate, into the partition's
        optimizer only when it steps: they are copied here first, so the saved ones are current.
        """
        copy_settings(optimizer.param_groups, optimizer.optim.param_groups)
        return get_optimizer_state_dict(model, optimizer.optim, options=BY_PARAMETER_NAME)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        load_keeping_kernels(model, optimizer.optim, state)
        # ZeRO's own groups are the ones it steps with: they take the restored settings.
        copy_settings(optimizer.optim.param_groups, optimizer.param_groups)


def copy_settings(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Every setting of each parameter group (learning rate, betas, ...) but its parameters."""
    for group, copy in zip(source, target, strict=True):
        copy.update({key: value for key, value in group.items() if key != "params"})
