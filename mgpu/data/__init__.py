"""Data sets: each option yields a train and a held-out split of (input, label) tensors.

A held-out split may add figures of its own beside the eval loss (`eval_metrics(loss)`, e.g. a
language model's perplexity and a baseline); a data set may state facts about itself that its
settings do not (`run_params()`, e.g. the corpus size), logged as the run's params."""

from __future__ import annotations

from typing import Protocol

from torch.utils.data import Dataset


class DataSource(Protocol):
    #: Samples are token sequences (input shape (T,)) over `num_classes` tokens, each position
    #: labelled with the next token; else images (C, H, W) with one class label each.
    next_token: bool
    #: Global batch per optimizer step, all ranks together (samples: images or sequences).
    batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int

    def splits(self, seed: int) -> tuple[Dataset, Dataset]:
        """(train, held-out) data sets, the same on every rank."""
