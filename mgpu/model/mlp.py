"""Multi-layer perceptron over flattened inputs."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    batch_statistics = False
    language_model = False

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: list[int] = (256, 256),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        sizes = [math.prod(input_shape), *hidden]
        # No Dropout module at p=0: it would still cost a call per layer and step.
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(i, o), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []))
            for i, o in zip(sizes[:-1], sizes[1:], strict=True)
        )
        self.head = nn.Linear(sizes[-1], num_classes)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
