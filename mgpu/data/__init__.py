"""Data sets: each option yields a train and a held-out split of (input, label) tensors."""

from __future__ import annotations

from typing import Protocol

from torch.utils.data import Dataset


class DataSource(Protocol):
    #: Global batch per optimizer step, all ranks together.
    batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int

    def splits(self, seed: int) -> tuple[Dataset, Dataset]:
        """(train, held-out) data sets, the same on every rank."""
