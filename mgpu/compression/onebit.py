"""1-bit sign compression with error feedback: the idea behind 1-bit Adam.

Each rank adds its residual to the gradient bucket, sends the signs packed 8 per byte plus one
fp32 scale (the mean absolute value), and keeps as its new residual what that missed. The ranks'
payloads travel by all_gather (gloo and nccl alike); every rank decodes all of them and takes
the mean, so all ranks apply the same update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mgpu.compression.commhook import CommHookCompression
from mgpu.errors import ConfigError

BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per value (1 where value >= 0), 8 to a byte, the last byte padded with zeros."""
    bits = (values.reshape(-1) >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8))
    return (bits.view(-1, 8) * BIT_WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """±1.0 per value from `pack_signs` output; leading dimensions (one row per rank) are kept."""
    bits = (packed.unsqueeze(-1) & BIT_WEIGHTS.to(packed.device)) != 0
    bits = bits.flatten(-2)[..., :numel]
    return bits.to(torch.float32) * 2 - 1


def encode(compensated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, transmitted): packed signs + fp32 scale as 4 bytes; the value they stand for."""
    scale = compensated.abs().mean().to(torch.float32).reshape(1)
    packed = pack_signs(compensated)
    transmitted = torch.where(compensated >= 0, scale, -scale).to(compensated.dtype)
    return torch.cat([packed, scale.view(torch.uint8)]), transmitted


def decode_mean(payloads: torch.Tensor, numel: int) -> torch.Tensor:
    """The mean over ranks (rows of `payloads`) of each rank's scale x signs."""
    signs = unpack_signs(payloads[:, :-4], numel)
    scales = payloads[:, -4:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return (signs * scales).mean(dim=0)


class OneBit(CommHookCompression):
    stateful = True  # error-feedback residuals and the step count

    def __init__(self, warmup_steps: int = 50) -> None:
        super().__init__()
        if warmup_steps < 0:
            raise ConfigError(f"compression.warmup_steps={warmup_steps}: must be >= 0")
        self.warmup_steps = warmup_steps
        self.step = 0  # synchronised steps so far (resumes with the residuals)
        self.names: dict[int, str] = {}  # id(parameter) -> name
        # Residuals per parameter, so they survive DDP re-bucketing; each is a view into the
        # flat residual of the bucket that holds the parameter now.
        self.residuals: dict[str, torch.Tensor] = {}
        self.flat: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}  # bucket -> (names, flat)

    def register(self, model: nn.Module) -> None:
        module = getattr(model, "module", model)
        self.names = {id(p): name for name, p in module.named_parameters()}
        super().register(model)

    def hook(self, group, bucket):
        step = self.step
        if bucket.is_last():
            self.step += 1
        if step < self.warmup_steps:
            return self.allreduce_hook(group, bucket)
        buffer = bucket.buffer()
        residual = self.bucket_residual(bucket)
        compensated = buffer + residual
        payload, transmitted = encode(compensated)
        torch.sub(compensated, transmitted, out=residual)  # what this rank's message missed

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(decode_mean(fut.value(), buffer.numel()))
            return buffer

        return self.all_gather(payload, group).then(decompress)

    def bucket_residual(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The bucket's flat residual, rebuilt from the per-parameter ones for a new layout."""
        params = bucket.parameters()
        names = tuple(self.names[id(p)] for p in params)
        layout, flat = self.flat.get(bucket.index(), ((), None))
        if layout == names:
            return flat
        pairs = list(zip(names, params, strict=True))
        pieces = [self.residuals.get(name, torch.zeros_like(p)).reshape(-1) for name, p in pairs]
        flat = torch.cat(pieces).to(bucket.buffer().dtype)
        if flat.numel() != bucket.buffer().numel():
            raise RuntimeError("DDP bucket is not its parameters laid end to end")
        for (name, param), view in zip(pairs, flat.split([p.numel() for p in params]), strict=True):
            self.residuals[name] = view.view_as(param)
        self.flat[bucket.index()] = (names, flat)
        return flat

    def state_dict(self) -> dict:
        """This rank's residuals by parameter name, and the step count (for `warmup_steps`)."""
        return {"step": self.step, "residuals": {n: r.clone() for n, r in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.residuals = {n: r.clone() for n, r in state["residuals"].items()}
        self.flat = {}
