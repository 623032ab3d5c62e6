"""Helpers shared by the parallel strategies: meshes, per-rank memory figures, checkpointing."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from mgpu.config import build
from mgpu.errors import ConfigError
from mgpu.options import import_target

if TYPE_CHECKING:
    from mgpu.config import Job

CHECKPOINTING = ("none", "full", "selective")


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank actually holds for `tensor` (its shard, for a DTensor)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    # ZeroRedundancyOptimizer keeps this rank's shard of the state in its inner optimizer.
    inner = getattr(optimizer, "optim", optimizer)
    return sum(
        local_bytes(value)
        for state in inner.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def memory_metrics(
    params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer
) -> dict[str, float]:
    """Parameter and optimizer-state bytes held by one rank, the largest over all ranks."""
    held = torch.tensor(
        [sum(local_bytes(p) for p in params), optimizer_state_bytes(optimizer)],
        dtype=torch.float64,
    )
    if dist.is_initialized():
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return {
        "memory/param_bytes_per_rank": held[0].item(),
        "memory/optimizer_bytes_per_rank": held[1].item(),
    }


def model_class(job: Job) -> type:
    return import_target(job.model["_target_"])


def data_input_shape(job: Job) -> tuple[int, ...]:
    """One sample's shape, from the data settings alone (nothing is loaded), for parent checks."""
    return tuple(build(job.data).input_shape)


def check_checkpointing(mode: str) -> None:
    if mode not in CHECKPOINTING:
        raise ConfigError(
            f"strategy.activation_checkpointing={mode}: use one of {', '.join(CHECKPOINTING)}"
        )


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing: keep matmul outputs, recompute the cheap pointwise ops."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute each block's activations in backward (`full`), or all but its matmuls
    (`selective`). Non-reentrant: the reentrant variant drops gradients when a block's inputs
    don't require grad."""
    if mode == "none":
        return
    blocks = set(model.blocks())
    kwargs = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, **kwargs),
        check_fn=lambda module: module in blocks,
    )
