"""Hybrid parallelism on one N-D DeviceMesh: data parallel × tensor parallel × pipeline parallel.

The mesh's dims are (pp, dp_replicate, dp_shard, tp) (`mgpu.parallel.plan`). Within each
pipeline stage: the model's tensor-parallel plan over `tp`, then activation checkpointing, then
FSDP2 over the data-parallel dims (sharded over `dp_shard` ranks, replicated over the rest:
HSDP), at dp=1 too: parameters then compute in the precision's dtype whatever the degree.
strategy=pp is this layout with only the pp dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mgpu.errors import ConfigError
from mgpu.parallel import FSDPOptions, ParallelPlan, PipelineOptions
from mgpu.strategy import Strategy

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options


class Hybrid(Strategy):
    supports_comm_hook = False
    shards_optimizer = True
    sets_reduce_dtype = True  # FSDP2's reduce_dtype: fp16/bf16 on the wire

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
        super().__init__(activation_checkpointing)
        self.dp, self.tp, self.pp, self.dp_shard = dp, tp, pp, dp_shard
        self.sequence_parallel = sequence_parallel
        self.world_size = dp * tp * pp  # launch.nproc_per_node=auto starts this many
        self.fsdp = FSDPOptions(reshard_after_forward, cpu_offload=False)
        self.pipeline = PipelineOptions(schedule, microbatches)

    @property
    def replicates_params(self) -> bool:
        return self.tp == 1 and self.pp == 1 and self.dp_shard == 1

    @property
    def uneven_batches(self) -> bool:
        """Data parallel alone: each rank's own work is its step less FSDP2's collectives
        (balance clock); tp and pp peers of one replica wait for each other inside every layer."""
        return self.tp == 1 and self.pp == 1

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def model_plans(self) -> tuple[str, ...]:
        return ("tp_plan",) * (self.tp > 1) + ("pipeline_stage",) * (self.pp > 1)

    def plan(self, world_size: int) -> ParallelPlan:
        """Its own degrees, whatever `world_size` (`validate` checks they multiply to it)."""
        return ParallelPlan(
            pp=self.pp, dp_replicate=self.dp // self.dp_shard, dp_shard=self.dp_shard,
            tp=self.tp, data_parallel=self.fsdp,
            pipeline=self.pipeline if self.pp > 1 else None,
            sequence_parallel=self.sequence_parallel,
            activation_checkpointing=self.activation_checkpointing,
        )

    def validate(self, job: Job, options: Options) -> None:
        world = job.launch.world_size
        if self.dp * self.tp * self.pp != world:
            raise ConfigError(
                f"strategy dp={self.dp} x tp={self.tp} x pp={self.pp} = "
                f"{self.dp * self.tp * self.pp}: must equal the world size {world} "
                f"(launch.nproc_per_node x nnodes)"
            )
        super().validate(job, options)
