"""Uneven shares of the global batch: rank r takes a contiguous slice of every global batch.

Every epoch has one global order, a permutation seeded by `seed + epoch` (the one a single
process walks with `strategy=single`); its tail that does not fill a whole global batch is
dropped. Step k's global batch is the next `global_batch` samples of that order, and the ranks
cut it into consecutive slices of `sizes[0], sizes[1], ...` samples. The sizes may change
between steps (rebalancing) without any sample being dropped or repeated, and the data position
is a global sample index (samples of the order consumed by all ranks together), valid at any
world size and any split.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mgpu.runtime import Runtime


def epoch_order(num_samples: int, global_batch: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's sample order, cut to whole global batches."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)[: num_samples // global_batch
                                                             * global_batch]


class RankSlices(Sampler[list[int]]):
    """This rank's slice of each global batch, from the position on; reads the split lazily."""

    def __init__(self, shares: ShareBatches) -> None:
        self.shares = shares

    def __iter__(self) -> Iterator[list[int]]:
        shares = self.shares
        while True:
            order = shares.order()
            start = shares.position % len(order)
            low = sum(shares.sizes[: shares.rank])
            shares.position += shares.global_batch  # consumed once fetched, whatever comes next
            yield order[start + low : start + low + shares.sizes[shares.rank]].tolist()


class ShareBatches:
    """Endless (inputs, labels) micro-batches of this rank's share, on `rt.device`.

    Each step's share is cut into `grad_accum` micro-batches of near-equal size (each rank's
    share is >= grad_accum). `set_sizes` takes effect at the next global batch; call it between
    steps.
    """

    def __init__(self, dataset: Dataset, sizes: list[int], grad_accum: int, rt: Runtime,
                 seed: int) -> None:
        self.global_batch = sum(sizes)
        if len(dataset) < self.global_batch:
            raise ValueError(f"a global batch of {self.global_batch} exceeds the data set")
        self.num_samples, self.seed, self.rank = len(dataset), seed, rt.rank
        self.sizes, self.grad_accum, self.device = list(sizes), grad_accum, rt.device
        self.position = 0  # global sample index: samples of all epochs' orders consumed
        self._order: tuple[int, torch.Tensor] | None = None
        self.loader = DataLoader(dataset, batch_sampler=RankSlices(self),
                                 pin_memory=rt.device.type == "cuda")
        self.iterator = iter(self.loader)
        self.micro_batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def order(self) -> torch.Tensor:
        epoch = self.position // (self.num_samples // self.global_batch * self.global_batch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.num_samples, self.global_batch, self.seed,
                                              epoch))
        return self._order[1]

    def set_sizes(self, sizes: list[int]) -> None:
        """A new split of the same global batch, from the next global batch on."""
        if sum(sizes) != self.global_batch or self.micro_batches:
            raise ValueError(f"split {sizes} must sum to {self.global_batch}, between steps")
        self.sizes = list(sizes)
        self.iterator = iter(self.loader)  # no slice of the old split is left prefetched

    def __iter__(self) -> ShareBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.micro_batches:
            inputs, labels = next(self.iterator)
            on_cuda = self.device.type == "cuda"
            inputs = inputs.to(self.device, non_blocking=on_cuda)
            labels = labels.to(self.device, non_blocking=on_cuda)
            self.micro_batches = list(zip(inputs.tensor_split(self.grad_accum),
                                          labels.tensor_split(self.grad_accum), strict=True))
        return self.micro_batches.pop(0)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]
        self.iterator = iter(self.loader)
