"""What the compressions that run as a DDP comm hook share.

Registration on the wrapped model (which strategies take one is a rule in `mgpu.support`),
and the bytes on the wire: every tensor a hook hands to a collective goes through
`all_reduce`/`all_gather` below, which count its bytes, so `comm/bytes_per_step` is measured,
not derived from a formula (PowerSGD's collectives run inside torch: there torch's own tally
of each tensor is used).
"""

# No `from __future__ import annotations` here: DDP compares a hook's annotations with the
# real classes (dist.GradBucket, Future[Tensor]) and rejects them as strings.

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.6 has only the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommHookCompression:
    """Base of the options that are DDP comm hooks; a subclass writes `hook(state, bucket)`."""

    needs_comm_hook = True
    stateful = False
    exact = False  # what arrives is a rounded or compressed copy of the averaged gradients

    def __init__(self) -> None:
        # Since the last `metrics()` call:
        self.sent_bytes = 0  # handed to collectives by this rank
        self.plain_bytes = 0  # the bucket buffers DDP gave the hook: what it would all-reduce
        self.synced_steps = 0  # backward passes whose gradients reached the hook

    def register(self, model: nn.Module) -> None:
        if not hasattr(model, "register_comm_hook"):
            raise TypeError(f"{type(self).__name__} needs a DDP model, got {type(model).__name__}")
        model.register_comm_hook(self.hook_state(model), self._measured)

    def hook_state(self, model: nn.Module) -> object:
        """What DDP hands the hook as its state: by default the model's process group."""
        return model.process_group

    def hook(self, state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        raise NotImplementedError

    def _measured(self, state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        self.plain_bytes += bucket.buffer().nbytes
        if bucket.is_last():  # DDP calls the hook once per bucket per synchronised step
            self.synced_steps += 1
        return self.hook(state, bucket)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Future[torch.Tensor]:
        """Sum `tensor` over `group` in place, counting its bytes; the future holds the tensor."""
        self.sent_bytes += tensor.nbytes
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def all_gather(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Future[torch.Tensor]:
        """Every rank's `tensor`, stacked in rank order, counting this rank's bytes."""
        self.sent_bytes += tensor.nbytes
        gathered = tensor.new_empty(group.size() * tensor.numel())  # gloo wants it flat
        work = all_gather_single(gathered, tensor, group=group, async_op=True)
        return work.get_future().then(lambda _: gathered.view(group.size(), *tensor.shape))

    def allreduce_hook(self, group: dist.ProcessGroup, bucket: dist.GradBucket
                       ) -> Future[torch.Tensor]:
        """torch's `allreduce_hook` (the mean of the bucket over ranks), counted."""
        tensor = bucket.buffer()
        tensor.div_(group.size())  # before the sum, as DDP does, so fp16 cannot overflow
        return self.all_reduce(tensor, group)

    def metrics(self) -> dict[str, float]:
        """Bytes sent per step and the ratio plain / sent, over the steps since the last call."""
        if not self.synced_steps:
            return {}
        figures = {
            "comm/bytes_per_step": self.sent_bytes / self.synced_steps,
            "comm/compression_ratio": self.plain_bytes / self.sent_bytes,
        }
        self.sent_bytes = self.plain_bytes = self.synced_steps = 0
        return figures

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
