"""One process, no communication: the reference every parallel strategy must match."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mgpu.errors import ConfigError
from mgpu.parallel import ParallelPlan
from mgpu.strategy import Strategy

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options


class Single(Strategy):
    world_size = 1
    replicates_params = True
    supports_comm_hook = False
    shards_optimizer = False
    pipelined = False
    uneven_batches = True  # one share: the whole batch
    model_plans = ()

    def plan(self, world_size: int) -> ParallelPlan:
        return ParallelPlan(activation_checkpointing=self.activation_checkpointing)

    def validate(self, job: Job, options: Options) -> None:
        if job.launch.world_size != 1:
            raise ConfigError(
                f"strategy=single runs one process but launch.nproc_per_node="
                f"{job.launch.nproc_per_node} x nnodes={job.launch.nnodes} gives "
                f"{job.launch.world_size}; use launch.nproc_per_node=auto or strategy=ddp"
            )
        super().validate(job, options)
