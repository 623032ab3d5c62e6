"""Pipeline parallel: the model cut into consecutive stages, one per rank (two for interleaved
1F1B), with micro-batches flowing through on a torch.distributed.pipelining schedule."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from mgpu.parallel import apply_checkpointing, check_checkpointing, memory_metrics, model_class
from mgpu.pipeline import Pipeline, check_pipeline, stages_per_rank
from mgpu.runtime import Runtime
from mgpu.strategy import Strategy, with_rank

if TYPE_CHECKING:
    from mgpu.config import Job


class PP(Strategy):
    world_size = None
    replicates_params = False
    supports_comm_hook = False
    shards_optimizer = True  # each rank steps its own stages' parameters
    pipelined = True
    uneven_batches = False  # every rank reads the same samples
    model_plans = ("pipeline_stage",)

    def __init__(
        self, schedule: str = "1f1b", microbatches: int = 4, activation_checkpointing: str = "none"
    ) -> None:
        check_checkpointing(activation_checkpointing)
        self.schedule = schedule
        self.microbatches = microbatches
        self.activation_checkpointing = activation_checkpointing
        self.pipe: Pipeline | None = None

    def validate(self, job: Job) -> None:
        pp = job.launch.world_size
        check_pipeline(job, self.schedule, self.microbatches, pp, dp=1)
        model_class(job).check_parallel(job.model, tp=1, pp=pp * stages_per_rank(self.schedule))

    def wrap(
        self, model: nn.Module, rt: Runtime, network: object, precision: object
    ) -> nn.Module:
        def prepare(stage: nn.Module) -> nn.Module:
            apply_checkpointing(stage, self.activation_checkpointing)
            return stage

        self.pipe = Pipeline(
            model, dist.group.WORLD, rt.device, self.schedule, self.microbatches, prepare
        )
        return self.pipe.modules

    def data_runtime(self, rt: Runtime) -> Runtime:
        return with_rank(rt, 0, 1)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()

    def forward_backward(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, precision: object,
        divisor: float, timer: object,
    ) -> torch.Tensor:
        # The schedule interleaves forward and backward passes: timed as one phase.
        with timer.phase("backward"), precision.autocast(inputs.device):
            return self.pipe.forward_backward(inputs, labels)

    def predict(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return self.pipe.predict(inputs)

    def metrics(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        return {**memory_metrics(model.parameters(), optimizer), **self.pipe.bubble_metrics()}

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.pipe.full_state_dict()
