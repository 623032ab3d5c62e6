"""Activation checkpointing: blocks recompute their activations in backward instead of keeping
them, trading compute for memory."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from mgpu.errors import ConfigError

CHECKPOINTING = ("none", "full", "selective")


def check_activation_recompute(mode: str) -> None:
    """ConfigError unless `mode` is a checkpointing mode (when the strategy is configured)."""
    if mode not in CHECKPOINTING:
        raise ConfigError(
            f"strategy.activation_checkpointing={mode}: use one of {', '.join(CHECKPOINTING)}"
        )


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing: keep matmul outputs, recompute the cheap pointwise ops."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_activations(model: nn.Module, mode: str) -> None:
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
