"""Tensor parallel: each block's weights split over ranks by the model's plan (DTensor
`parallelize_module`); every rank reads the same samples and holds the rest replicated."""

from __future__ import annotations

from mgpu.parallel import ParallelPlan
from mgpu.strategy import Strategy


class TP(Strategy):
    world_size = None
    replicates_params = False
    supports_comm_hook = False
    shards_optimizer = True  # the state of each split weight is split with it
    pipelined = False
    uneven_batches = False  # every rank reads the same samples
    model_plans = ("tp_plan",)

    def __init__(
        self, sequence_parallel: bool = False, activation_checkpointing: str = "none"
    ) -> None:
        super().__init__(activation_checkpointing)
        self.sequence_parallel = sequence_parallel

    def plan(self, world_size: int) -> ParallelPlan:
        return ParallelPlan(
            tp=world_size, sequence_parallel=self.sequence_parallel,
            activation_checkpointing=self.activation_checkpointing,
        )
