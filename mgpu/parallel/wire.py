"""Bytes on the wire of tensor parallelism: the functional collectives DTensor issues.

DTensor turns an op on sharded tensors into local ops and `_c10d_functional` collectives on
plain tensors, inside its own dispatch. A dispatch mode sees those collectives if it lets
DTensor's ops through to DTensor first (it returns NotImplemented for them, as torch's
CommDebugMode does), so the ops it then sees are the desugared ones.

Counted on one training step: the collectives follow the tensors' shapes, which are the same
every step, and a Python dispatch mode costs time on every op it sees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from mgpu.compression.commhook import (
    all_gather_wire_bytes,
    all_reduce_wire_bytes,
    all_to_all_wire_bytes,
)

_ops = torch.ops._c10d_functional
#: Per functional collective: (its input tensor, its group's size) -> bytes this rank sends,
#: by the ring accounting of `comm/bytes_per_step`. Each takes its group's name last.
WIRE_BYTES: dict[object, Callable[[torch.Tensor, int], float]] = {
    _ops.all_reduce.default: lambda t, g: all_reduce_wire_bytes(t.nbytes, g),
    _ops.all_reduce_.default: lambda t, g: all_reduce_wire_bytes(t.nbytes, g),
    _ops.all_gather_into_tensor.default: lambda t, g: all_gather_wire_bytes(t.nbytes, g),
    _ops.reduce_scatter_tensor.default: lambda t, g: all_to_all_wire_bytes(t.nbytes, g),
    _ops.all_to_all_single.default: lambda t, g: all_to_all_wire_bytes(t.nbytes, g),
}


class DTensorWireCount(TorchDispatchMode):
    """While active: the bytes this rank sends in DTensor's collectives, in `wire_bytes`."""

    def __init__(self) -> None:
        super().__init__()
        self.wire_bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first: its collectives come back here
        count = WIRE_BYTES.get(func)
        if count is not None:
            self.wire_bytes += count(args[0], _resolve_process_group(args[-1]).size())
        return func(*args, **(kwargs or {}))
