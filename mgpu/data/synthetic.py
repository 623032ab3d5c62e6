"""Generated images: one random prototype per class plus Gaussian noise. Any size, no download."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from mgpu.errors import ConfigError


class Synthetic:
    next_token = False
    def __init__(
        self,
        batch_size: int = 64,
        num_samples: int = 4096,
        num_classes: int = 10,
        image_size: int = 8,
        noise: float = 0.5,
        val_fraction: float = 0.2,
    ) -> None:
        if not 0 < val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction}: must be between 0 and 1")
        if num_classes < 2 or num_samples < 2 * num_classes:
            raise ConfigError(
                f"data.num_samples={num_samples}, data.num_classes={num_classes}: need at least "
                "2 classes and 2 samples per class"
            )
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.input_shape = (1, image_size, image_size)
        self.noise = noise
        self.val_fraction = val_fraction

    def splits(self, seed: int) -> tuple[TensorDataset, TensorDataset]:
        gen = torch.Generator().manual_seed(seed)
        prototypes = torch.rand((self.num_classes, *self.input_shape), generator=gen)
        labels = torch.randint(self.num_classes, (self.num_samples,), generator=gen)
        noise = torch.randn((self.num_samples, *self.input_shape), generator=gen)
        images = prototypes[labels] + self.noise * noise
        n_val = int(self.num_samples * self.val_fraction)
        return (
            TensorDataset(images[n_val:], labels[n_val:]),
            TensorDataset(images[:n_val], labels[:n_val]),
        )
