"""Models. Each is an nn.Module built from its YAML settings plus the data's shape, and names
its repeated blocks so strategies know where to cut (sharding units, checkpointing)."""

from __future__ import annotations

from typing import Protocol

from torch import nn


class Model(Protocol):
    #: It normalises over the batch (BatchNorm): a rank's local batch changes its outputs.
    batch_statistics: bool

    def __call__(self, x): ...

    def blocks(self) -> list[nn.Module]:
        """The model's repeated units, in order."""
