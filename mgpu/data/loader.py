"""Data loaders: each rank draws its share of every global batch, in an order fixed by the seed."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from mgpu.runtime import Runtime


def train_batches(
    dataset: Dataset, micro_batch: int, rt: Runtime, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, labels) micro-batches on `rt.device`, reshuffled every epoch.

    DistributedSampler hands rank r every world_size-th sample of the epoch's permutation, so
    the ranks' micro-batches of one step together are the same samples a single process would
    take as its batch: the basis of DDP's parity with one process.
    """
    sampler = DistributedSampler(
        dataset, num_replicas=rt.world_size, rank=rt.rank, shuffle=True, seed=seed, drop_last=True
    )
    on_cuda = rt.device.type == "cuda"
    loader = DataLoader(
        dataset, batch_size=micro_batch, sampler=sampler, drop_last=True, pin_memory=on_cuda
    )
    if len(loader) == 0:
        raise ValueError(f"a micro-batch of {micro_batch} is larger than this rank's data share")
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            yield (
                inputs.to(rt.device, non_blocking=on_cuda),
                labels.to(rt.device, non_blocking=on_cuda),
            )
        epoch += 1


def eval_batches(dataset: Dataset, batch_size: int, rt: Runtime) -> DataLoader:
    """This rank's slice of the held-out set: every sample on exactly one rank, none padded."""
    shard = Subset(dataset, range(rt.rank, len(dataset), rt.world_size))
    return DataLoader(shard, batch_size=batch_size, pin_memory=rt.device.type == "cuda")
