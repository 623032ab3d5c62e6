"""scikit-learn's handwritten digits: 1797 8x8 grey images, 10 classes, shipped in the package."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from mgpu.errors import ConfigError


class Digits:
    next_token = False
    input_shape = (1, 8, 8)
    num_classes = 10

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2) -> None:
        if not 0 < val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction}: must be between 0 and 1")
        self.batch_size = batch_size
        self.val_fraction = val_fraction

    def splits(self, seed: int) -> tuple[TensorDataset, TensorDataset]:
        # The split is stratified and fixed (not tied to `seed`), so runs with different seeds
        # are evaluated on the same held-out images.
        images, labels = load_digits(return_X_y=True)
        x_train, x_val, y_train, y_val = train_test_split(
            images, labels, test_size=self.val_fraction, stratify=labels, random_state=0
        )
        return _as_dataset(x_train, y_train), _as_dataset(x_val, y_val)


def _as_dataset(images, labels) -> TensorDataset:
    # Pixel values are 0..16; scale to 0..1 so every model sees inputs of unit range.
    x = torch.as_tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    return TensorDataset(x, torch.as_tensor(labels, dtype=torch.long))
