"""Tensor parallel: each block's weights split over ranks by the model's plan (DTensor
`parallelize_module`); every rank reads the same samples and holds the rest replicated."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from mgpu.parallel import (
    apply_checkpointing,
    check_checkpointing,
    data_input_shape,
    model_class,
)
from mgpu.runtime import Runtime
from mgpu.strategy import Strategy, with_rank

if TYPE_CHECKING:
    from mgpu.config import Job


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
        check_checkpointing(activation_checkpointing)
        self.sequence_parallel = sequence_parallel
        self.activation_checkpointing = activation_checkpointing

    def validate(self, job: Job) -> None:
        model_class(job).check_parallel(
            job.model, tp=job.launch.world_size, pp=1,
            sequence_parallel=self.sequence_parallel, input_shape=data_input_shape(job),
        )

    def wrap(
        self, model: nn.Module, rt: Runtime, network: object, precision: object
    ) -> nn.Module:
        mesh = init_device_mesh(rt.device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
        model = split_blocks(model.to(rt.device), mesh, self.sequence_parallel)
        apply_checkpointing(model, self.activation_checkpointing)
        return model

    def data_runtime(self, rt: Runtime) -> Runtime:
        return with_rank(rt, 0, 1)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()


def split_blocks(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Apply the model's tensor-parallel plan to each of its blocks over the 1-D `mesh`.

    With sequence parallelism the stream stays split along the sequence from the first block
    to the last (of this pipeline stage, under pp), so only those two convert it."""
    blocks = model.blocks()
    for block in blocks:
        parallelize_module(block, mesh, model.tp_plan(sequence_parallel))
    if sequence_parallel:
        enter, leave = model.tp_sequence_bounds()
        parallelize_module(blocks[0], mesh, enter)
        parallelize_module(blocks[-1], mesh, leave)
    return model
