"""Hybrid parallelism on one N-D DeviceMesh: data parallel × tensor parallel × pipeline parallel.

The mesh's dims are (pp, dp_replicate, dp_shard, tp), tp innermost so tensor-parallel peers sit
on neighbouring ranks. Within each pipeline stage: the model's tensor-parallel plan over `tp`,
then activation checkpointing, then FSDP2 over the data-parallel dims (sharded over `dp_shard`
ranks, replicated over the rest: HSDP). TP with FSDP2 on one mesh, not a separate DDP wrapper,
because DDP over a TP mesh trains while hiding the parameters from state_dict().
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mgpu.errors import ConfigError
from mgpu.parallel import (
    apply_checkpointing,
    check_checkpointing,
    data_input_shape,
    memory_metrics,
    model_class,
)
from mgpu.pipeline import Pipeline, check_pipeline, stages_per_rank
from mgpu.runtime import Runtime
from mgpu.strategy import Strategy, with_rank
from mgpu.strategy.fsdp import FSDP, gradient_sync_off, shard_model
from mgpu.strategy.tp import split_blocks

if TYPE_CHECKING:
    from mgpu.config import Job


class Hybrid(Strategy):
    supports_comm_hook = False
    shards_optimizer = True
    uneven_batches = False  # FSDP gathers inside forward and backward

    def __init__(
        self,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        dp_shard: int | None = None,
        sequence_parallel: bool = False,
        reshard_after_forward: bool = True,
        schedule: str = "1f1b",
        microbatches: int = 4,
        activation_checkpointing: str = "none",
    ) -> None:
        for key, value in (("dp", dp), ("tp", tp), ("pp", pp)):
            if value < 1:
                raise ConfigError(f"strategy.{key}={value}: must be >= 1")
        dp_shard = dp if dp_shard is None else dp_shard
        if dp_shard < 1 or dp % dp_shard:
            raise ConfigError(
                f"strategy.dp_shard={dp_shard}: must divide strategy.dp={dp} (null = all of dp)"
            )
        check_checkpointing(activation_checkpointing)
        self.dp, self.tp, self.pp, self.dp_shard = dp, tp, pp, dp_shard
        self.sequence_parallel = sequence_parallel
        self.world_size = dp * tp * pp  # launch.nproc_per_node=auto starts this many
        self.fsdp = FSDP(reshard_after_forward, cpu_offload=False)
        self.schedule, self.microbatches = schedule, microbatches
        self.activation_checkpointing = activation_checkpointing
        self.mesh: DeviceMesh | None = None
        self.pipe: Pipeline | None = None

    @property
    def replicates_params(self) -> bool:
        return self.tp == 1 and self.pp == 1 and self.dp_shard == 1

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def model_plans(self) -> tuple[str, ...]:
        return ("tp_plan",) * (self.tp > 1) + ("pipeline_stage",) * (self.pp > 1)

    def validate(self, job: Job) -> None:
        world = job.launch.world_size
        if self.dp * self.tp * self.pp != world:
            raise ConfigError(
                f"strategy dp={self.dp} x tp={self.tp} x pp={self.pp} = "
                f"{self.dp * self.tp * self.pp}: must equal the world size {world} "
                f"(launch.nproc_per_node x nnodes)"
            )
        if self.pp > 1:
            check_pipeline(job, self.schedule, self.microbatches, self.pp, self.dp)
        if self.tp > 1 or self.pp > 1:
            model_class(job).check_parallel(
                job.model, tp=self.tp, pp=self.pp * stages_per_rank(self.schedule),
                sequence_parallel=self.sequence_parallel, input_shape=data_input_shape(job),
            )

    def wrap(
        self, model: nn.Module, rt: Runtime, network: object, precision: object
    ) -> nn.Module:
        self.mesh = init_device_mesh(
            rt.device.type,
            (self.pp, self.dp // self.dp_shard, self.dp_shard, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )

        def prepare(part: nn.Module) -> nn.Module:
            if self.tp > 1:
                split_blocks(part, self.mesh["tp"], self.sequence_parallel)
            apply_checkpointing(part, self.activation_checkpointing)
            dp_mesh = self.mesh["dp_replicate", "dp_shard"]
            return shard_model(part, dp_mesh, self.fsdp, precision, rt)

        if self.pp == 1:
            return prepare(model.to(rt.device))
        self.pipe = Pipeline(
            model, self.mesh["pp"].get_group(), rt.device, self.schedule, self.microbatches,
            prepare,
        )
        return self.pipe.modules

    def data_runtime(self, rt: Runtime) -> Runtime:
        """Ranks that differ only in their tp or pp coordinate read the same samples."""
        replica = self.mesh["dp_replicate"].get_local_rank()
        shard = self.mesh["dp_shard"].get_local_rank()
        return with_rank(rt, replica * self.dp_shard + shard, self.dp)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext() if self.pipe else gradient_sync_off(model)

    def forward_backward(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, precision: object,
        divisor: float, timer: object,
    ) -> torch.Tensor:
        if self.pipe is None:
            return super().forward_backward(model, inputs, labels, precision, divisor, timer)
        # The schedule interleaves forward and backward passes: timed as one phase.
        with timer.phase("backward"), precision.autocast(inputs.device):
            return self.pipe.forward_backward(inputs, labels)

    def predict(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return self.pipe.predict(inputs) if self.pipe else model(inputs)

    def metrics(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        bubble = self.pipe.bubble_metrics() if self.pipe else {}
        return {**memory_metrics(model.parameters(), optimizer), **bubble}

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.pipe.full_state_dict() if self.pipe else super().full_state_dict(model)
