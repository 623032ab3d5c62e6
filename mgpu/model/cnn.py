"""Small convolutional network for image inputs (C, H, W)."""

from __future__ import annotations

import torch
from torch import nn


class CNN(nn.Module):
    batch_statistics = True  # BatchNorm
    language_model = False

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        channels: list[int] = (32, 64),
        hidden: int = 128,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"model=cnn needs image inputs (C, H, W), got shape {input_shape}")
        sizes = [input_shape[0], *channels]
        self.convs = nn.ModuleList(
            nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())
            for i, o in zip(sizes[:-1], sizes[1:], strict=True)
        )
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(sizes[-1] * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def blocks(self) -> list[nn.Module]:
        return list(self.convs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = conv(x)
        return self.head(self.pool(x))
