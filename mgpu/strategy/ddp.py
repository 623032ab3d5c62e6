"""Distributed data parallel: a full replica per rank, gradients all-reduced in buckets."""

from __future__ import annotations

from mgpu.parallel import DDPOptions, ParallelPlan
from mgpu.strategy import Strategy


class DDP(Strategy):
    world_size = None
    replicates_params = True
    supports_comm_hook = True  # compressions and balance=ssp register DDP comm hooks
    shards_optimizer = False
    pipelined = False
    uneven_batches = True  # the all-reduce starts once a rank's own backward is done
    model_plans = ()

    def __init__(
        self,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        activation_checkpointing: str = "none",
    ) -> None:
        super().__init__(activation_checkpointing)
        self.ddp = DDPOptions(find_unused_parameters, static_graph)

    def plan(self, world_size: int) -> ParallelPlan:
        return ParallelPlan(
            dp_replicate=world_size, data_parallel=self.ddp,
            activation_checkpointing=self.activation_checkpointing,
        )
