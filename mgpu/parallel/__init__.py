"""How a model is laid out over the ranks.

`plan` states a layout as data (mesh degrees, data-parallel kind, pipeline, checkpointing);
`layout.parallelize` applies any plan in one fixed order; `fsdp` and `recompute` are two
of its steps.
"""

from mgpu.parallel.layout import Layout, parallelize
from mgpu.parallel.plan import DDPOptions, FSDPOptions, ParallelPlan, PipelineOptions
from mgpu.parallel.recompute import check_activation_recompute, recompute_activations

__all__ = [
    "DDPOptions",
    "FSDPOptions",
    "Layout",
    "ParallelPlan",
    "PipelineOptions",
    "recompute_activations",
    "check_activation_recompute",
    "parallelize",
]
