"""Models. Each is an nn.Module built from its YAML settings plus the data's shape, and names
its repeated blocks so strategies know where to cut (sharding units, checkpointing).

The input shape says what a sample is: (C, H, W) an image, labelled with one of `num_classes`
classes; (T,) a sequence of token ids from a vocabulary of `num_classes`, each position labelled
with the token after it (data sets that declare `next_token`), which only a model that
declares `language_model` reads."""

from __future__ import annotations

from typing import Protocol

from torch import nn


class Model(Protocol):
    #: It normalises over the batch (BatchNorm): a rank's local batch changes its outputs.
    batch_statistics: bool
    #: It reads token sequences and predicts the next token at every position.
    language_model: bool

    def __call__(self, x): ...

    def blocks(self) -> list[nn.Module]:
        """The model's repeated units, in order."""
