"""Tensor parallel: each block's weights split over ranks by the model's plan (DTensor
`parallelize_module`); every rank reads the same samples and holds the rest replicated."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from mgpu.parallel import apply_checkpointing, check_checkpointing, require_model
from mgpu.runtime import Runtime
from mgpu.strategy import Strategy, with_rank


class TP(Strategy):
    world_size = None
    supports_comm_hook = False

    def __init__(self, activation_checkpointing: str = "none") -> None:
        check_checkpointing(activation_checkpointing)
        self.activation_checkpointing = activation_checkpointing

    def validate(self, job: dict) -> None:
        model = require_model(job, "tp", "tp_plan", "a tensor-parallel plan")
        model.check_parallel(job["model"], tp=job["launch"]["world_size"], pp=1)

    def wrap(
        self, model: nn.Module, rt: Runtime, network: object, precision: object
    ) -> nn.Module:
        mesh = init_device_mesh(rt.device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
        model = split_blocks(model.to(rt.device), mesh)
        apply_checkpointing(model, self.activation_checkpointing)
        return model

    def data_runtime(self, rt: Runtime) -> Runtime:
        return with_rank(rt, 0, 1)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()


def split_blocks(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Apply the model's tensor-parallel plan to each of its blocks over the 1-D `mesh`."""
    for block in model.blocks():
        parallelize_module(block, mesh, model.tp_plan())
    return model
