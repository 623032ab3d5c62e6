"""What the compressions that run as a DDP comm hook share.

The strategy rule (checked in the parent), registration on the wrapped model, and the bytes on
the wire: every tensor a hook hands to a collective goes through `all_reduce`/`all_gather`
below, which count its bytes, so `comm/bytes_per_step` is measured, not derived from a formula
(PowerSGD's collectives run inside torch: there torch's own tally of each tensor is used).
"""

# No `from __future__ import annotations` here: DDP compares a hook's annotations with the
# real classes (dist.GradBucket, Future[Tensor]) and rejects them as strings.

from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.futures import Future

from mgpu.config import import_target
from mgpu.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.6 has only the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: Class attribute a strategy sets to True when the model it wraps takes a DDP comm hook.
CARRIES_HOOK = "supports_comm_hook"


def options(group: str) -> dict[str, str]:
    """{option name: _target_} of the YAML files in conf/<group>/."""
    found = {}
    for path in sorted((CONF / group).glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        if target:
            found[path.stem] = target
    return found


def carries_comm_hook(target: str) -> bool:
    try:
        return bool(getattr(import_target(target), CARRIES_HOOK, False))
    except ConfigError:
        return False


def option_name(group: str, target: str) -> str:
    """The option name a `_target_` has in conf/<group>/, else the target itself."""
    return next((name for name, t in options(group).items() if t == target), target)


def require_comm_hook(compression: object, job: dict) -> None:
    """ConfigError unless the job's strategy wraps the model in something that takes a comm hook.

    Data-driven: a strategy class opts in with `supports_comm_hook = True`, so strategies added
    later plug in without a change here.
    """
    strategy = job["strategy"]["_target_"]
    if carries_comm_hook(strategy):
        return
    own = option_name("compression", f"{type(compression).__module__}.{type(compression).__name__}")
    able = [name for name, target in options("strategy").items() if carries_comm_hook(target)]
    why = "one process has nothing to communicate" if job["launch"]["world_size"] == 1 else (
        "it takes no DDP comm hook")
    fix = " or ".join(f"strategy={s}" for s in able) or f"a strategy with {CARRIES_HOOK} = True"
    raise ConfigError(
        f"compression={own} cannot run with strategy={option_name('strategy', strategy)} ({why}); "
        f"use {fix}, or compression=none"
    )


class CommHookCompression:
    """Base of the options that are DDP comm hooks; a subclass writes `hook(state, bucket)`."""

    def __init__(self) -> None:
        # Since the last `metrics()` call:
        self.sent_bytes = 0  # handed to collectives by this rank
        self.plain_bytes = 0  # the bucket buffers DDP gave the hook: what it would all-reduce
        self.synced_steps = 0  # backward passes whose gradients reached the hook

    def validate(self, job: dict) -> None:
        require_comm_hook(self, job)

    def register(self, model: nn.Module) -> None:
        if not hasattr(model, "register_comm_hook"):
            raise TypeError(f"{type(self).__name__} needs a DDP model, got {type(model).__name__}")
        model.register_comm_hook(self.hook_state(model), self._measured)

    def hook_state(self, model: nn.Module) -> object:
        """What DDP hands the hook as its state: by default the model's process group."""
        return model.process_group

    def hook(self, state: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        raise NotImplementedError

    def begin_step(self, grad_scale: torch.Tensor) -> None:
        pass

    def end_step(self, applied: bool) -> None:
        pass

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
