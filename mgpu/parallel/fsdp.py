"""FSDP2 as the data-parallel step of a layout: parameters, gradients and optimizer state
sharded over the data-parallel ranks, each block gathered just before it computes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

# The collectives FSDP2 runs by default, to count what they send (`count_collectives`): torch
# exports the hook that replaces them (FSDPModule.set_custom_all_gather), not these classes.
# Older torch (2.6) has neither, and its FSDP2 runs log no comm/bytes_per_step.
try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    COUNTABLE = hasattr(FSDPModule, "set_custom_all_gather")
except ImportError:
    DefaultAllGather = DefaultReduceScatter = object
    COUNTABLE = False
from torch.nn.modules.batchnorm import _BatchNorm

from mgpu.parallel.plan import FSDPOptions


def shard_model(
    model: nn.Module, mesh: DeviceMesh, fsdp: FSDPOptions, precision: object,
    device: torch.device, reduce_dtype: torch.dtype,
) -> nn.Module:
    """fully_shard each block, then the root (embedding, head and the rest) over `mesh`,
    gradients reduce-scattered in `reduce_dtype` (the precision's, or a compression's).

    Batch norms are sharded first, as units of their own that keep fp32 parameters: their
    running statistics are fp32 buffers, which a bf16/fp16 `param_dtype` would leave beside
    low-precision weights that batch_norm refuses. Autocast still runs the convolutions around
    them in the low precision."""
    options = {
        "mesh": mesh,
        "reshard_after_forward": fsdp.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=precision.param_dtype, reduce_dtype=reduce_dtype
        ),
    }
    if fsdp.cpu_offload:
        # Pinned host memory needs CUDA; without it the default pin_memory=True fails.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)
    for norm in (m for m in model.modules() if isinstance(m, _BatchNorm)):
        fully_shard(norm, **{**options, "mp_policy": fp32})
    for block in model.blocks():
        fully_shard(block, **options)
    model = fully_shard(model, **options)
    follow_first_rank_buffers(model, mesh)
    return model


def follow_first_rank_buffers(model: nn.Module, mesh: DeviceMesh) -> None:
    """Before every forward, the model's buffers (batch norms' running statistics) become those
    of the mesh's first rank, as DDP's `broadcast_buffers` does. FSDP shards parameters but
    leaves buffers to each rank, which would update them from its own batches only: ranks
    would then evaluate, and save, different models."""
    buffers = list(model.buffers())
    if not buffers or mesh.size() == 1:
        return
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]

    def broadcast(module: nn.Module, args: object) -> None:
        for group in groups:  # along each dim from its first rank: all end as rank (0, 0, ...)
            for buffer in buffers:
                dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)

    model.register_forward_pre_hook(broadcast)


@contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally; reduce-scatter only on the last micro-batch."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class WireCount:
    """Bytes this rank sends in FSDP2's all-gathers (parameters) and reduce-scatters
    (gradients) during training steps: `comm/bytes_per_step` for a sharded model, as DDP's
    buckets give it for a replicated one. Ring convention (`mgpu/compression/commhook.py`): a
    collective over W ranks of a whole buffer of S bytes sends (W - 1) / W x S from each rank,
    in the dtype it runs in (the parameter dtype, the reduce dtype)."""

    def __init__(self) -> None:
        self.training = False  # evaluation's all-gathers are no step's
        self.wire_bytes, self.steps = 0.0, 0
        # Once a balance's step clock asks (`StepClock.attach`): its marks, and the (start, end)
        # marks of every call since it last took them. A rank waits for its peers inside these
        # calls, so their time is not its own work.
        self.marks = None
        self.spans: list[tuple[object, object]] = []

    def timed(self, call, *args: object) -> object:
        """`call(*args)`, its span kept where a clock asks: on CPU the host's time in the
        (blocking) gloo call, on CUDA the collective's own time on the stream it runs on."""
        if self.marks is None:
            return call(*args)
        start = self.marks.mark()
        result = call(*args)
        self.spans.append((start, self.marks.mark()))
        return result

    def add(self, whole: torch.Tensor, group: dist.ProcessGroup) -> None:
        if self.training:
            self.wire_bytes += (group.size() - 1) / group.size() * whole.nbytes

    def begin_step(self) -> None:
        self.training = True
        self.steps += 1

    def end_step(self) -> None:
        self.training = False

    def metrics(self) -> dict[str, float]:
        """Bytes per step since the last call ({} where nothing was sent: one rank)."""
        figures = {"comm/bytes_per_step": self.wire_bytes / self.steps} if (
            self.steps and self.wire_bytes) else {}
        self.wire_bytes, self.steps = 0.0, 0
        return figures


class CountedAllGather(DefaultAllGather):
    """FSDP2's own all-gather, its output (every rank's shards) counted."""

    def __init__(self, count: WireCount) -> None:
        super().__init__()
        self.count = count

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.count.add(output_tensor, group)
        return self.count.timed(super().__call__, output_tensor, input_tensor, group, async_op)


class CountedReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter, its input (the whole gradients) counted."""

    def __init__(self, count: WireCount) -> None:
        super().__init__()
        self.count = count

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.count.add(input_tensor, group)
        return self.count.timed(super().__call__, output_tensor, input_tensor, group, op,
                                async_op)


def count_collectives(model: nn.Module) -> WireCount | None:
    """The count of the bytes every FSDP2 unit in `model` sends, or None where there are none
    (or this torch lets no collective be replaced: set_custom_all_gather came after 2.6). One
    per model, installed at the first call: the compression counts its bytes, a balance's
    step clock times its calls."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units or not COUNTABLE:
        return None
    count = getattr(model, "_wire_count", None)
    if count is None:
        count = WireCount()
        for unit in units:
            unit.set_custom_all_gather(CountedAllGather(count))
            unit.set_custom_reduce_scatter(CountedReduceScatter(count))
        model._wire_count = count
    return count
