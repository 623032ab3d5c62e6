"""How a model is laid out over the ranks.

`plan` states a layout as data (mesh degrees, data-parallel kind, pipeline, checkpointing);
`layout.parallelize` applies any plan in one fixed order; `fsdp` and `checkpointing` are two
of its steps.
"""

from mgpu.parallel.checkpointing import apply_checkpointing, check_checkpointing
from mgpu.parallel.layout import Layout, parallelize
from mgpu.parallel.plan import DDPOptions, FSDPOptions, ParallelPlan, PipelineOptions

__all__ = [
    "DDPOptions",
    "FSDPOptions",
    "Layout",
    "ParallelPlan",
    "PipelineOptions",
    "apply_checkpointing",
    "check_checkpointing",
    "parallelize",
]
