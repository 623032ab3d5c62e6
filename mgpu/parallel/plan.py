"""The parallel plan: how a strategy lays one model out over the ranks, as plain data.

Every strategy states its layout as one `ParallelPlan` — the degrees of the four mesh dims,
how the data-parallel ranks keep their parameters in step, whether the model runs as a
pipeline, and what its blocks recompute — so one code path (`mgpu.parallel.layout`) builds
every strategy's model, and strategy=pp and strategy=hybrid's pp dim are the same pipeline.

Mesh dims run (pp, dp_replicate, dp_shard, tp), tp innermost so tensor-parallel peers sit on
neighbouring ranks (as torchtitan orders them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mgpu.model import PipelineStages
from mgpu.options import import_target
from mgpu.pipeline import check_pipeline, stages_per_rank

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class DDPOptions:
    """Data parallel by whole replicas: DDP all-reduces gradients in buckets, through the one
    comm hook a compression or a balance may install."""

    find_unused_parameters: bool = False
    static_graph: bool = False


@dataclass(frozen=True)
class FSDPOptions:
    """Data parallel by FSDP2: each parameter sharded over the dp_shard ranks and replicated
    over the dp_replicate ones (HSDP where both are > 1)."""

    #: True frees gathered blocks after forward (ZeRO-3); False keeps them to backward (ZeRO-2).
    reshard_after_forward: bool = True
    #: Sharded parameters, gradients and optimizer state live in host memory.
    cpu_offload: bool = False


@dataclass(frozen=True)
class PipelineOptions:
    """The model cut into stages along the pp dim, driven by a pipelining schedule."""

    #: A key of `mgpu.pipeline.SCHEDULES`: gpipe | 1f1b (one stage per rank) | interleaved_1f1b |
    #: looped_bfs | interleaved_zb (two stages per rank, looped) | zbv | dualpipev (two, in a V) |
    #: 2bw (PipeDream-2BW's one-step-stale update, one stage per rank).
    schedule: str = "1f1b"
    #: Micro-batches per step.
    microbatches: int = 4


@dataclass(frozen=True)
class ParallelPlan:
    """One model's layout over the ranks; the product of the degrees is the world size."""

    #: Pipeline degree: ranks the model's stages are spread over. 1 means one stage per chunk.
    pp: int = 1
    #: Ranks that hold whole copies of each parameter (DDP's replicas, HSDP's replicate dim).
    dp_replicate: int = 1
    #: Ranks that shard each parameter between them (FSDP2).
    dp_shard: int = 1
    #: Tensor-parallel degree: ranks that split each block's weights. 1 means disabled.
    tp: int = 1
    #: How the data-parallel ranks keep parameters in step; None: nothing to synchronise.
    data_parallel: DDPOptions | FSDPOptions | None = None
    #: The schedule the stages run on; None: no pipeline.
    pipeline: PipelineOptions | None = None
    #: With tp > 1, also split norms and the residual stream along the sequence.
    sequence_parallel: bool = False
    #: none | full | selective: what each block recomputes in backward.
    activation_checkpointing: str = "none"

    @property
    def dp(self) -> int:
        """Data-parallel degree: model replicas reading different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def shards(self) -> bool:
        """FSDP2 holds the parameters (sharded, or replicated by HSDP), not whole modules."""
        return isinstance(self.data_parallel, FSDPOptions)

    def mesh_dims(self) -> dict[str, int]:
        """{dim name: degree} of the mesh the plan needs, in `MESH_DIMS` order: every dim of
        degree > 1, and a dim of one rank where a step still runs over it (the pipeline's pp,
        whose schedule sends along it; FSDP's dp_shard, which casts and holds parameters by
        its mesh even when nothing is sharded)."""
        degrees = dict(zip(MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                           strict=True))
        needed = {"pp": self.pipeline is not None, "dp_shard": self.shards}
        return {name: n for name, n in degrees.items() if n > 1 or needed.get(name, False)}

    def device_mesh(self, device: torch.device) -> DeviceMesh | None:
        """The one DeviceMesh every step of the layout slices (None where no dim is needed:
        one process, or DDP on the default group)."""
        dims = self.mesh_dims()
        if not dims:
            return None
        return init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))

    def check(self, model_node: dict[str, Any], data: Any) -> None:
        """ConfigError where the data (its batch, its sample shape: nothing is loaded) or the
        model cannot take this plan (parent, before launch); the world size is the strategy's
        own check, in its own keys."""
        stages = 1
        if self.pipeline is not None:
            schedule, microbatches = self.pipeline.schedule, self.pipeline.microbatches
            check_pipeline(data.batch_size, schedule, microbatches, self.pp, self.dp,
                           self.shards, self.tp)
            stages = PipelineStages(self.pp, stages_per_rank(schedule), schedule)
        if self.tp > 1 or stages > 1:
            import_target(model_node["_target_"]).check_parallel(
                model_node, tp=self.tp, pp=stages, sequence_parallel=self.sequence_parallel,
                input_shape=tuple(data.input_shape),
            )
