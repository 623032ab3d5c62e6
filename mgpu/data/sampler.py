"""The data position: how far into the epoch's global sample order the run has got.

Every epoch has one global order (a permutation seeded by `seed + epoch`), the same at any
world size; its tail that does not fill a whole global batch is dropped. A step consumes the
next `global_batch` samples of it, and the ranks cut that global batch into consecutive slices
of `sizes[0], sizes[1], ...` samples. So the position saved in a checkpoint is a global sample
index, not per-rank iterator state: a run saved at world size 4 resumes at world size 2 (or 1),
or with another split, with no sample of the epoch skipped or repeated.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class GlobalOrderSampler(Sampler[list[int]]):
    """Batch sampler, endless: this rank's slice of each global batch, as `grad_accum`
    micro-batches of near-equal size, from the data position on.

    The ranks' slices of one global batch together are the samples one process takes as its
    batch: the basis of parity with one process, at any split. `sizes` is read when a global
    batch starts, so `set_sizes` between steps changes the split from the next step on.
    """

    def __init__(self, num_samples: int, sizes: list[int], grad_accum: int, rank: int,
                 seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.sizes, self.grad_accum, self.rank = list(sizes), grad_accum, rank
        self.global_batch = sum(sizes)
        self.epoch_length = num_samples // self.global_batch * self.global_batch
        self.epoch, self.position = 0, 0  # the next global batch starts here
        self._order: tuple[int, torch.Tensor] | None = None

    def set_sizes(self, sizes: list[int]) -> None:
        """A new split of the same global batch, used from the next global batch on."""
        if sum(sizes) != self.global_batch:
            raise ValueError(f"split {sizes} must sum to the global batch {self.global_batch}")
        self.sizes = list(sizes)

    def set_position(self, epoch: int, position: int) -> None:
        """Start the next global batch at sample `position` of `epoch`'s order (the end of an
        epoch is the start of the next)."""
        skipped, self.position = divmod(position, self.epoch_length)
        self.epoch = epoch + skipped

    def epoch_order(self) -> torch.Tensor:
        """This epoch's sample order, cut to whole global batches (computed once per epoch)."""
        if self._order is None or self._order[0] != self.epoch:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator)[: self.epoch_length]
            self._order = (self.epoch, order)
        return self._order[1]

    def rank_share(self) -> torch.Tensor:
        """This rank's slice of the global batch at the position."""
        start = self.position + sum(self.sizes[: self.rank])
        return self.epoch_order()[start : start + self.sizes[self.rank]]

    def index_batches(self) -> Iterator[torch.Tensor]:
        """This rank's micro-batches as index tensors, endless, from the position on."""
        while True:
            share = self.rank_share()
            # The global batch counts as consumed once its first micro-batch is fetched: between
            # steps the position is where the next step starts.
            self.set_position(self.epoch, self.position + self.global_batch)
            yield from share.tensor_split(self.grad_accum)

    def __iter__(self) -> Iterator[list[int]]:
        return (micro.tolist() for micro in self.index_batches())
