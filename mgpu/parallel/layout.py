"""A model laid out by its `ParallelPlan`: one function for every strategy, in a fixed order.

On the model, or on each pipeline stage: tensor parallelism over tp → activation
checkpointing → data parallelism (FSDP2 over the data-parallel dims, or DDP). A pipeline first
cuts the model into this rank's stages and each stage takes the same steps, as torchtitan
parallelises each stage it splits: so strategy=pp and strategy=hybrid's pp dim are one code
path with different degrees. The order matters: TP turns a block's linear layers into DTensor
layers, checkpointing then wraps the block, and FSDP2 shards last, on the same mesh as TP
(DDP over a TP mesh trains while hiding the parameters from state_dict()).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from mgpu.parallel.fsdp import shard_model
from mgpu.parallel.plan import DATA_PARALLEL_DIMS, DDPOptions, FSDPOptions, ParallelPlan
from mgpu.parallel.recompute import recompute_activations
from mgpu.pipeline import Pipeline
from mgpu.runtime import Runtime


@dataclass(frozen=True)
class Layout:
    """What `parallelize` made of a model on this rank."""

    plan: ParallelPlan
    mesh: DeviceMesh | None
    #: What the run trains and checkpoints: the (wrapped) model, or this rank's stages.
    model: nn.Module
    #: The schedule and this rank's stages where the plan has a pipeline.
    pipe: Pipeline | None = None

    def data_runtime(self, runtime: Runtime) -> Runtime:
        """`runtime` as the data loaders should see it: rank and size within the data-parallel dims
        (ranks that differ only in their tp or pp coordinate read the same samples)."""
        rank = 0
        for name in DATA_PARALLEL_DIMS:
            if self.mesh is not None and name in self.mesh.mesh_dim_names:
                rank = rank * self.mesh[name].size() + self.mesh[name].get_local_rank()
        return dataclasses.replace(runtime, rank=rank, world_size=self.plan.dp)


def parallelize(
    model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh | None, device: torch.device,
    precision: object, network: object, wire_dtype: torch.dtype | None = None,
) -> Layout:
    """`model` laid out by `plan` over `mesh` on `device`: the pipeline split first, where the
    plan has one, then `parallelize_stage` on the model or on each of this rank's stages.
    `precision` gives FSDP its dtypes (`wire_dtype`, where a compression sets one, the dtype
    it reduce-scatters gradients in), `network` DDP its buckets."""
    prepare = partial(
        parallelize_stage, plan=plan, mesh=mesh, device=device, precision=precision,
        network=network, wire_dtype=wire_dtype,
    )
    if plan.pipeline is None:
        return Layout(plan, mesh, prepare(model.to(device)))
    pipe = Pipeline(
        model, mesh["pp"].get_group(), device, plan.pipeline.schedule,
        plan.pipeline.microbatches, prepare,
    )
    return Layout(plan, mesh, pipe.modules, pipe)


def parallelize_stage(
    part: nn.Module, plan: ParallelPlan, mesh: DeviceMesh | None, device: torch.device,
    precision: object, network: object, wire_dtype: torch.dtype | None = None,
) -> nn.Module:
    """TP → activation checkpointing → FSDP2 or DDP, each where the plan asks for it, on a
    model already on `device` (the whole model, or one pipeline stage of it)."""
    if plan.tp > 1:
        split_blocks(part, mesh["tp"], plan.sequence_parallel)
    recompute_activations(part, plan.activation_checkpointing)
    if isinstance(plan.data_parallel, FSDPOptions):
        return shard_model(part, data_parallel_mesh(mesh), plan.data_parallel, precision, device,
                           wire_dtype or precision.reduce_dtype)
    if isinstance(plan.data_parallel, DDPOptions):
        return replicate(part, plan.data_parallel, device, network)
    return part


def sequential_redistribute_warning(record: logging.LogRecord) -> bool:
    """Whether a log record is not DTensor's "While redistributing from ... N sequential
    ... operations will be performed. This is suboptimal" warning."""
    return not str(record.msg).startswith("While redistributing from")


def split_blocks(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Apply the model's tensor-parallel plan to each of its blocks over the 1-D `mesh`.

    With sequence parallelism the stream stays split along the sequence from the first block
    to the last (of this pipeline stage, under pp), so only those two convert it."""
    # FSDP2 over TP (hybrid) stores each weight as (_StridedShard, Shard): gathering it whole
    # (saving model.pt) takes two sequential all-gathers, which DTensor reports on the console
    # of every rank. It is this layout's cost, not something a user can change: not shown.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    if sequential_redistribute_warning not in redistribute_log.filters:
        redistribute_log.addFilter(sequential_redistribute_warning)
    blocks = model.blocks()
    for block in blocks:
        parallelize_module(block, mesh, model.tp_plan(sequence_parallel))
    if sequence_parallel:
        enter, leave = model.tp_sequence_bounds()
        parallelize_module(blocks[0], mesh, enter)
        parallelize_module(blocks[-1], mesh, leave)
    return model


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dims of `mesh`: 2-D (replicate, shard) for HSDP, else dp_shard alone."""
    names = tuple(name for name in DATA_PARALLEL_DIMS if name in mesh.mesh_dim_names)
    return mesh[names if len(names) > 1 else names[0]]


def replicate(
    model: nn.Module, ddp: DDPOptions, device: torch.device, network: object
) -> DistributedDataParallel:
    """A whole replica per rank, gradients all-reduced in the network option's buckets."""
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=network.bucket_cap_mb,
        gradient_as_bucket_view=network.gradient_as_bucket_view,
        find_unused_parameters=ddp.find_unused_parameters,
        static_graph=ddp.static_graph,
    )
