"""Parallel strategies: how the model is placed on ranks and how its gradients are synchronised."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from torch import nn

from mgpu.runtime import Runtime


class Strategy(Protocol):
    #: Number of processes the strategy requires, or None for any.
    world_size: int | None

    def validate(self, job: dict) -> None:
        """Raise ConfigError for settings this strategy cannot run with (parent, before launch)."""

    def wrap(self, model: nn.Module, rt: Runtime, network: object) -> nn.Module:
        """Return the model placed on `rt.device` and ready for data-parallel training."""

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Context for micro-batches whose gradients are only accumulated, not synchronised."""
