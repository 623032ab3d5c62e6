"""Data loaders: each rank draws its share of every global batch, in an order fixed by the seed.

A data set held in tensors (a `TensorDataset`, as digits and synthetic are) is cut into
batches by indexing those tensors with the micro-batch's indices: one gather per tensor, where
a DataLoader fetches every sample on its own and stacks them again (most of a small model's
step on CPU). On CUDA such a data set is moved to the device once, when it fits
`DEVICE_RESIDENT_BYTES`, so a step copies nothing from the host but its indices. A data set
that cuts a batch itself (`batch(indices)`, as text's windows do) is asked for each batch.
Any other data set goes through a DataLoader with the same sampler.

A plain DataLoader rather than torchdata's StatefulDataLoader: its state is this rank's
iterator (micro-batches yielded, to fast-forward, plus per-worker snapshots), which means
nothing at another world size or split, and where a sampler has a state of its own it only
carries that; the sampler's global position is the whole state here, saved directly.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate

from mgpu.data.sampler import GlobalOrderSampler
from mgpu.loss import IGNORED_LABEL
from mgpu.runtime import Runtime

#: The largest tensor data set moved to a CUDA device whole (else batches are copied per step).
DEVICE_RESIDENT_BYTES = 1 << 30


def resident_tensors(dataset: Dataset, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """The tensors of a `TensorDataset`, where batches can be cut from them directly: on
    `device` when they fit `DEVICE_RESIDENT_BYTES`, else where they are (None: another kind of
    data set, read through a DataLoader)."""
    if not isinstance(dataset, TensorDataset):
        return None
    tensors = dataset.tensors
    if device.type == "cuda" and sum(t.nbytes for t in tensors) <= DEVICE_RESIDENT_BYTES:
        tensors = tuple(t.to(device) for t in tensors)
    return tensors


class TrainBatches:
    """Endless (inputs, labels) micro-batches of this rank's share, on `runtime.device`.

    `sizes` is every rank's share of the global batch (summing to it, each >= `grad_accum`);
    each step's share comes as `grad_accum` micro-batches of near-equal size. The ranks' shares
    of one step together are the global batch a single process would take: the basis of
    parity with one process, even when `set_sizes` changes the split between steps. `state_dict`
    is the data position in global terms (epoch, samples of the epoch consumed), valid at any
    world size and any split.
    """

    def __init__(self, dataset: Dataset, sizes: list[int], grad_accum: int, runtime: Runtime,
                 seed: int) -> None:
        if sum(sizes) > len(dataset) or min(sizes) < grad_accum:
            raise ValueError(f"split {sizes} of {len(dataset)} samples: the global batch must "
                             f"fit the data and each share hold {grad_accum} micro-batch(es)")
        self.runtime = runtime
        self.sampler = GlobalOrderSampler(len(dataset), sizes, grad_accum, runtime.rank, seed)
        self.on_cuda = runtime.device.type == "cuda"
        self.tensors = resident_tensors(dataset, runtime.device)
        self.cut = getattr(dataset, "batch", None)
        self.loader = None
        if self.tensors is None and self.cut is None:
            self.loader = DataLoader(dataset, batch_sampler=self.sampler, pin_memory=self.on_cuda)
        self.iterator = self.batches()

    def batches(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """The micro-batches from the sampler's position on, as they come from the data."""
        if self.loader is not None:
            return iter(self.loader)
        if self.tensors is None:
            return (self.cut(indices) for indices in self.sampler.index_batches())
        return (tuple(t[indices.to(t.device)] for t in self.tensors)
                for indices in self.sampler.index_batches())

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = next(self.iterator)
        return (inputs.to(self.runtime.device, non_blocking=self.on_cuda),
                labels.to(self.runtime.device, non_blocking=self.on_cuda))

    def set_sizes(self, sizes: list[int]) -> None:
        """A new split of the same global batch, from the next global batch on."""
        self.sampler.set_sizes(sizes)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "position": self.sampler.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.set_position(state["epoch"], state["position"])
        self.iterator = self.batches()  # nothing of the old position is left in flight


class EvalBatches:
    """This rank's slice of the held-out set, in as many batches as every other rank's.

    Sharded strategies gather parameters inside every forward pass, so all ranks must run the
    same number of them. Ranks take every `world_size`-th sample, so rank 0's slice is the
    longest; a rank whose slice runs out earlier fills each missing batch with one sample
    labelled IGNORED_LABEL, which counts nowhere. Every real sample is on exactly one rank.
    """

    def __init__(self, dataset: Dataset, batch_size: int, runtime: Runtime) -> None:
        self.dataset = dataset
        shard = Subset(dataset, range(runtime.rank, len(dataset), runtime.world_size))
        pin = runtime.device.type == "cuda"
        self.loader = DataLoader(shard, batch_size=batch_size, pin_memory=pin)
        longest_shard = -(-len(dataset) // runtime.world_size)
        self.num_batches = -(-longest_shard // batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from self.loader
        for _ in range(self.num_batches - len(self.loader)):
            yield self.filler()

    def eval_metrics(self, loss: float) -> dict[str, float]:
        """What the held-out set reports beside its loss and accuracy, where it has anything
        (token windows: perplexity and the unigram baseline, `TokenWindows.eval_metrics`)."""
        extra = getattr(self.dataset, "eval_metrics", None)
        return extra(loss) if extra else {}

    def filler(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of one sample that counts nowhere: its label is IGNORED_LABEL."""
        inputs, labels = default_collate([self.dataset[0]])
        return inputs, torch.full_like(labels, IGNORED_LABEL)
