"""float16 on the wire: torch's fp16 compression, half the bytes of fp32."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

from mgpu.compression.commhook import CommHookCompression


class Fp16(CommHookCompression):
    """torch's `fp16_compress_wrapper` around a counted all-reduce.

    torch documents `fp16_compress_hook` as equal to `fp16_compress_wrapper(allreduce_hook)`;
    the wrapper form lets the cast tensor pass through `all_reduce` here, where it is counted.
    """

    wire_dtype = torch.float16  # under FSDP: its reduce-scatter's dtype, no hook

    def __init__(self) -> None:
        super().__init__()
        self._hook = fp16_compress_wrapper(self.allreduce_hook)

    def hook(self, group, bucket):
        return self._hook(group, bucket)
