"""Fully sharded data parallel (FSDP2): parameters, gradients and optimizer state sharded over
ranks, each block gathered just before it computes.

`reshard_after_forward=true` frees gathered blocks after forward (ZeRO-3); false keeps them to
backward (ZeRO-2: more memory, one all-gather less per block).
"""

from __future__ import annotations

from mgpu.parallel import FSDPOptions, ParallelPlan
from mgpu.strategy import Strategy


class FSDP(Strategy):
    world_size = None
    replicates_params = False
    supports_comm_hook = False
    shards_optimizer = True
    sets_reduce_dtype = True  # FSDP2's reduce_dtype: fp16/bf16 on the wire
    pipelined = False
    # A rank's step time less its time in FSDP2's collectives is its own work (balance clock).
    uneven_batches = True
    model_plans = ()

    def __init__(
        self,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: str = "none",
    ) -> None:
        super().__init__(activation_checkpointing)
        self.fsdp = FSDPOptions(reshard_after_forward, cpu_offload)

    def plan(self, world_size: int) -> ParallelPlan:
        return ParallelPlan(
            dp_shard=world_size, data_parallel=self.fsdp,
            activation_checkpointing=self.activation_checkpointing,
        )
