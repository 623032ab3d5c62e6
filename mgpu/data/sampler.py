"""The data position: how far into the epoch's global sample order the run has got.

Every epoch has one global order (a permutation seeded by `seed + epoch`), the same at any
world size. A step consumes the next `global_batch` samples of it, whichever ranks take them,
so the position saved in a checkpoint is a global sample index, not per-rank iterator state:
a run saved at world size 4 resumes at world size 2 (or 1) with no sample of the epoch skipped
or repeated. Which samples of a global batch a rank takes is decided in `rank_share` alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class GlobalOrderSampler(Sampler[int]):
    """This rank's indices for the rest of an epoch, from a global sample position on.

    Rank r takes every world_size-th sample of the epoch's order (as DistributedSampler does),
    so the ranks' micro-batches of one step are together the samples one process would take.
    The epoch's tail that does not fill a whole global batch is dropped.
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int,
                 seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.rank, self.world_size = rank, world_size
        self.epoch_length = num_samples // global_batch * global_batch  # samples used per epoch
        self.epoch, self.position = 0, 0

    def set_epoch(self, epoch: int, position: int = 0) -> None:
        """Start at `position` (a global sample index, a multiple of the world size)."""
        self.epoch, self.position = epoch, position

    def epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator)[: self.epoch_length].tolist()

    def rank_share(self, order: list[int]) -> list[int]:
        return order[self.position + self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_share(self.epoch_order()))

    def __len__(self) -> int:
        return (self.epoch_length - self.position) // self.world_size
