"""Data loaders: each rank draws its share of every global batch, in an order fixed by the seed."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from mgpu.data.sampler import GlobalOrderSampler
from mgpu.runtime import Runtime


class TrainBatches:
    """Endless (inputs, labels) micro-batches on `rt.device`, reshuffled every epoch.

    The ranks' micro-batches of one step together are the same samples a single process would
    take as its batch: the basis of DDP's parity with one process. `state_dict` is the data
    position in global terms (epoch, samples of the epoch consumed), valid at any world size.
    """

    def __init__(self, dataset: Dataset, micro_batch: int, global_batch: int, grad_accum: int,
                 rt: Runtime, seed: int) -> None:
        self.rt = rt
        self.global_micro_batch = global_batch // grad_accum  # samples per micro-batch, all ranks
        self.sampler = GlobalOrderSampler(len(dataset), global_batch, rt.rank, rt.world_size, seed)
        self.on_cuda = rt.device.type == "cuda"
        self.loader = DataLoader(dataset, batch_size=micro_batch, sampler=self.sampler,
                                 drop_last=True, pin_memory=self.on_cuda)
        if len(self.loader) == 0:
            raise ValueError(f"a micro-batch of {micro_batch} exceeds this rank's data share")
        self.epoch, self.position = 0, 0
        self.iterator = None

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= self.sampler.epoch_length:
            self.epoch, self.position, self.iterator = self.epoch + 1, 0, None
        if self.iterator is None:
            self.sampler.set_epoch(self.epoch, self.position)
            self.iterator = iter(self.loader)
        inputs, labels = next(self.iterator)
        self.position += self.global_micro_batch
        return (inputs.to(self.rt.device, non_blocking=self.on_cuda),
                labels.to(self.rt.device, non_blocking=self.on_cuda))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.iterator = state["epoch"], state["position"], None


def eval_batches(dataset: Dataset, batch_size: int, rt: Runtime) -> DataLoader:
    """This rank's slice of the held-out set: every sample on exactly one rank, none padded."""
    shard = Subset(dataset, range(rt.rank, len(dataset), rt.world_size))
    return DataLoader(shard, batch_size=batch_size, pin_memory=rt.device.type == "cuda")
