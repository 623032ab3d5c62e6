"""What the compressions that run as a DDP comm hook share.

The hook handed to `Trainer.build` for the wrapped model (which strategies take one is a rule in
`mgpu.support`), and the bytes on the wire: every tensor a hook hands to a collective goes through
`all_reduce`/`all_gather` below, which count what that collective sends from this rank
(PowerSGD's collectives run inside torch: there torch's own tally of each tensor it
all-reduces is counted the same way).

Bytes on the wire are those of the ring algorithm, the convention of nccl-tests' bus bandwidth
(`task=commbench`): to all-reduce S bytes over W ranks each rank sends 2(W-1)/W x S (a
reduce-scatter, then an all-gather, of W pieces of S/W); to all-gather P bytes from every rank,
each rank sends (W-1) x P. Plain all-reduce of the same buckets is the yardstick of
`comm/compression_ratio`, so a payload gathered from every rank (onebit) saves less on more
ranks, while a smaller dtype (fp16) saves the same at any world size.
"""

# No `from __future__ import annotations` here: DDP compares a hook's annotations with the
# real classes (dist.GradBucket, Future[Tensor]) and rejects them as strings.

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

from mgpu.compression import CommHook
from mgpu.parallel.fsdp import count_collectives

# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.6 has only the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_wire_bytes(nbytes: int, world_size: int) -> float:
    """Bytes one rank sends to all-reduce `nbytes` over `world_size` ranks (ring)."""
    return 2 * (world_size - 1) / world_size * nbytes


def all_to_all_wire_bytes(nbytes: int, world_size: int) -> float:
    """Bytes one rank sends to exchange `nbytes` in `world_size` equal pieces, one per rank
    (its own piece stays)."""
    return (world_size - 1) / world_size * nbytes


def all_gather_wire_bytes(nbytes: int, world_size: int) -> float:
    """Bytes one rank sends to all-gather `nbytes` from every one of `world_size` ranks (ring)."""
    return (world_size - 1) * nbytes


def wire_metrics(wire_bytes: float, plain_bytes: float, steps: int) -> dict[str, float]:
    """`comm/bytes_per_step` and `comm/compression_ratio` (plain all-reduce / actual), or {}
    where nothing went on the wire (no synchronised step, or a single rank)."""
    if not steps or not wire_bytes:
        return {}
    return {
        "comm/bytes_per_step": wire_bytes / steps,
        "comm/compression_ratio": plain_bytes / wire_bytes,
    }


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the model DDP wraps: state kept by name survives DDP's
    re-bucketing (after the first step of every run) and restores into any bucket layout."""
    return {id(p): name for name, p in getattr(model, "module", model).named_parameters()}


class CommHookCompression:
    """Base of the options that are DDP comm hooks; a subclass writes `hook(state, bucket)`."""

    needs_comm_hook = True
    stateful = False
    exact = False  # what arrives is a rounded or compressed copy of the averaged gradients
    wire_dtype: torch.dtype | None = None  # more than a dtype: only a comm hook can do it
    overlaps_steps = True  # stateless, or state kept by the step it belongs to (onebit)

    def __init__(self) -> None:
        self.world_size = 1  # of the model's process group, once registered
        # Since the last `metrics()` call, in bytes this rank sent:
        self.wire_bytes = 0.0  # by the hook's collectives
        self.plain_bytes = 0.0  # what plain all-reduce of the buckets DDP gave the hook sends
        self.synced_steps = 0  # backward passes whose gradients reached the hook
        self.names: dict[int, str] = {}  # id(parameter) -> name, once registered
        self.grad_scale: torch.Tensor | None = None  # the factor this step's gradients carry
        self.sharded = None  # under FSDP2: its collectives, counted (a WireCount)
        self.delay = 0  # steps between a hook's exchange and the step that applies it (ssp)

    def comm_hook(self, model: nn.Module) -> CommHook:
        """(state, hook) for `model`'s DDP: the subclass's hook, counting the plain bytes.
        None for a sharded model, where the compression is a wire dtype its layout applies (its
        collectives then counted as they run)."""
        if not hasattr(model, "register_comm_hook") and self.wire_dtype is not None:
            self.sharded = count_collectives(model)
            return None
        if not hasattr(model, "register_comm_hook"):
            raise TypeError(f"{type(self).__name__} needs a DDP model, got {type(model).__name__}")
        self.world_size = dist.get_world_size(model.process_group)
        self.names = parameter_names(model)
        return self.hook_state(model), self._measured

    def hook_state(self, model: nn.Module) -> object:
        """What DDP hands the hook as its state: by default the model's process group."""
        return model.process_group

    def hook(self, state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        raise NotImplementedError

    def applied_after(self, steps: int) -> None:
        self.delay = steps

    def begin_step(self, grad_scale: torch.Tensor | None) -> None:
        self.grad_scale = grad_scale
        if self.sharded:
            self.sharded.begin_step()

    def end_step(self, applied: bool) -> None:
        if self.sharded:
            self.sharded.end_step()

    def _measured(self, state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        self.count_bucket(bucket)
        return self.hook(state, bucket)

    def count_bucket(self, bucket: dist.GradBucket) -> None:
        """A bucket DDP handed over: what its plain all-reduce would send (the yardstick), and
        a synchronised step at the last one. Also called by a balance's hook that sends in
        this compression's `wire_dtype` (ssp)."""
        self.plain_bytes += all_reduce_wire_bytes(bucket.buffer().nbytes, self.world_size)
        if bucket.is_last():  # DDP calls the hook once per bucket per synchronised step
            self.synced_steps += 1

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Future[torch.Tensor]:
        """Sum `tensor` over `group` in place, counting its bytes; the future holds the tensor."""
        self.count_all_reduce(tensor.nbytes)
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def all_gather(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Future[torch.Tensor]:
        """Every rank's `tensor`, stacked in rank order, counting this rank's bytes."""
        self.wire_bytes += all_gather_wire_bytes(tensor.nbytes, group.size())
        gathered = tensor.new_empty(group.size() * tensor.numel())  # gloo wants it flat
        work = all_gather_single(gathered, tensor, group=group, async_op=True)
        return work.get_future().then(lambda _: gathered.view(group.size(), *tensor.shape))

    def all_to_all(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Future[torch.Tensor]:
        """Row i of `tensor` (one row per rank) goes to rank i; the future holds row i of every
        rank i, stacked in rank order. Counts the bytes this rank sends."""
        self.wire_bytes += all_to_all_wire_bytes(tensor.nbytes, group.size())
        received = torch.empty_like(tensor)
        work = dist.all_to_all_single(received, tensor, group=group, async_op=True)
        return work.get_future().then(lambda _: received)

    def allreduce_hook(self, group: dist.ProcessGroup, bucket: dist.GradBucket
                       ) -> Future[torch.Tensor]:
        """torch's `allreduce_hook` (the mean of the bucket over ranks), counted."""
        tensor = bucket.buffer()
        tensor.div_(group.size())  # before the sum, as DDP does, so fp16 cannot overflow
        return self.all_reduce(tensor, group)

    def count_all_reduce(self, nbytes: int) -> None:
        """Count an all-reduce of `nbytes` over the model's process group."""
        self.wire_bytes += all_reduce_wire_bytes(nbytes, self.world_size)

    def metrics(self) -> dict[str, float]:
        """Bytes on the wire per step and the ratio plain / actual, since the last call (under
        FSDP2, the bytes its collectives sent)."""
        if self.sharded:
            return self.sharded.metrics()
        figures = wire_metrics(self.wire_bytes, self.plain_bytes, self.synced_steps)
        self.wire_bytes = self.plain_bytes = 0.0
        self.synced_steps = 0
        return figures

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
