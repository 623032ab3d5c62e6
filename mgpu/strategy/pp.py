"""Pipeline parallel: the model cut into consecutive stages, one per rank (two for interleaved
1F1B), with micro-batches flowing through on a torch.distributed.pipelining schedule.

The same layout as strategy=hybrid with only its pp dim: every rank a stage, no data or tensor
parallelism, so every rank reads the same samples."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mgpu.parallel import ParallelPlan, PipelineOptions
from mgpu.pipeline import check_no_flush
from mgpu.strategy import Strategy

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options


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
        super().__init__(activation_checkpointing)
        self.pipeline = PipelineOptions(schedule, microbatches)

    def validate(self, job: Job, options: Options) -> None:
        super().validate(job, options)
        check_no_flush(self.pipeline.schedule, self.pipeline.microbatches, job.train.grad_accum,
                       options.precision.loss_scaling)

    def plan(self, world_size: int) -> ParallelPlan:
        return ParallelPlan(
            pp=world_size, pipeline=self.pipeline,
            activation_checkpointing=self.activation_checkpointing,
        )
