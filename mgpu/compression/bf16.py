"""bfloat16 on the wire: fp32's exponent range in half the bytes; runs on gloo and nccl."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_wrapper

from mgpu.compression.commhook import CommHookCompression


class Bf16(CommHookCompression):
    """torch's `bf16_compress_wrapper` around a counted all-reduce.

    DDP refuses torch's own bf16 hooks by their names unless it runs on NCCL >= 2.10, yet gloo
    all-reduces bfloat16 fine. Here DDP is handed this object's measuring hook, whose name it
    does not refuse, so the same code runs on gloo (CPU) and nccl (GPU).
    """

    wire_dtype = torch.bfloat16  # under FSDP: its reduce-scatter's dtype, no hook

    def __init__(self) -> None:
        super().__init__()
        self._hook = bf16_compress_wrapper(self.allreduce_hook)

    def hook(self, group, bucket):
        return self._hook(group, bucket)
