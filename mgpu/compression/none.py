"""No compression: gradients are all-reduced as they are (fp32 under fp32 precision)."""

from __future__ import annotations

from torch import nn

from mgpu.compression.commhook import CommHookCompression


class NoCompression(CommHookCompression):
    """Any strategy; on a DDP model the plain all-reduce is a hook, so its bytes are counted."""

    def validate(self, job: dict) -> None:
        pass

    def register(self, model: nn.Module) -> None:
        if hasattr(model, "register_comm_hook"):
            super().register(model)

    def hook(self, group, bucket):
        return self.allreduce_hook(group, bucket)
