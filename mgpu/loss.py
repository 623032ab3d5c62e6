"""The loss every strategy trains and evaluates with: cross-entropy over every labelled position."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A label no prediction equals and the loss leaves out (F.cross_entropy's default ignore_index).
IGNORED_LABEL = -100


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of `logits` (..., classes) against `labels` (...): one label per sample for
    a classifier, one per position for a language model (each position's next token), so the
    mean is per sample or per token. Positions labelled IGNORED_LABEL count nowhere."""
    return F.cross_entropy(
        logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORED_LABEL, reduction=reduction
    )
