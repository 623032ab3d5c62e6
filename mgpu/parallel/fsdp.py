"""FSDP2 as the data-parallel step of a layout: parameters, gradients and optimizer state
sharded over the data-parallel ranks, each block gathered just before it computes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.modules.batchnorm import _BatchNorm

from mgpu.parallel.plan import FSDPOptions


def shard_model(
    model: nn.Module, mesh: DeviceMesh, fsdp: FSDPOptions, precision: object,
    device: torch.device, reduce_dtype: torch.dtype,
) -> nn.Module:
    """fully_shard each block, then the root (embedding, head and the rest) over `mesh`,
    gradients reduce-scattered in `reduce_dtype` (the precision's, or a compression's).

    Batch norms are sharded first, as units of their own that keep fp32 parameters: their
    running statistics are fp32 buffers, which a bf16/fp16 `param_dtype` would leave beside
    low-precision weights that batch_norm refuses. Autocast still runs the convolutions around
    them in the low precision."""
    options = {
        "mesh": mesh,
        "reshard_after_forward": fsdp.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=precision.param_dtype, reduce_dtype=reduce_dtype
        ),
    }
    if fsdp.cpu_offload:
        # Pinned host memory needs CUDA; without it the default pin_memory=True fails.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)
    for norm in (m for m in model.modules() if isinstance(m, _BatchNorm)):
        fully_shard(norm, **{**options, "mp_policy": fp32})
    for block in model.blocks():
        fully_shard(block, **options)
    model = fully_shard(model, **options)
    follow_first_rank_buffers(model, mesh)
    return model


def follow_first_rank_buffers(model: nn.Module, mesh: DeviceMesh) -> None:
    """Before every forward, the model's buffers (batch norms' running statistics) become those
    of the mesh's first rank, as DDP's `broadcast_buffers` does. FSDP shards parameters but
    leaves buffers to each rank, which would update them from its own batches only: ranks
    would then evaluate, and save, different models."""
    buffers = list(model.buffers())
    if not buffers or mesh.size() == 1:
        return
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]

    def broadcast(module: nn.Module, args: object) -> None:
        for group in groups:  # along each dim from its first rank: all end as rank (0, 0, ...)
            for buffer in buffers:
                dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)

    model.register_forward_pre_hook(broadcast)


@contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally; reduce-scatter only on the last micro-batch."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
