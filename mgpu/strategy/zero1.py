"""ZeRO stage 1: DDP for gradients, optimizer state sharded over ranks (ZeroRedundancyOptimizer).

Each rank steps only its partition of the parameters and broadcasts the result, so optimizer
state per rank is about 1/world of DDP's while parameters and gradients stay whole.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.lr_scheduler import LambdaLR

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
