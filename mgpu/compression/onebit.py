"""1-bit sign compression with error feedback: the idea behind 1-bit Adam.

Each rank adds its residual to the gradient bucket, sends the signs packed 8 per byte plus one
fp32 scale per parameter (the mean absolute value of its values), and keeps as its new residual
what that missed. The ranks' payloads travel by all_gather (gloo and nccl alike); every rank
decodes all of them and takes the mean, so all ranks apply the same update.

A scale per parameter, not per bucket: which bucket a parameter lands in is DDP's choice (its
bucket size, and the rebuild after the first step of every run, resumed ones too), so with a
scale per bucket the update would depend on it; per parameter, a resumed run computes exactly
what the uninterrupted one did.

Residuals are kept in unscaled units (under amp the gradients arrive multiplied by the loss
scale, which changes between steps), and a step's new residuals are kept only if its optimizer
step was applied: a skipped non-finite step leaves them as they were, instead of an inf or NaN
that would poison every later step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def spread(scales: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each parameter's scale (last dimension) repeated over its `sizes[i]` values."""
    counts = torch.tensor(sizes, device=scales.device)
    return scales.repeat_interleave(counts, dim=-1, output_size=sum(sizes))


def encode(compensated: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, transmitted) for a bucket whose parameters have `sizes` values each: packed
    signs + one fp32 scale per parameter (4 bytes each); the value they stand for."""
    pieces = compensated.split(sizes)
    scales = torch.stack([piece.abs().mean() for piece in pieces]).to(torch.float32)
    values = spread(scales, sizes).to(compensated.dtype)
    transmitted = torch.where(compensated >= 0, values, -values)
    return torch.cat([pack_signs(compensated), scales.view(torch.uint8)]), transmitted


def decode_mean(payloads: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The mean over ranks (rows of `payloads`) of each rank's scales x signs."""
    scale_bytes = 4 * len(sizes)
    signs = unpack_signs(payloads[:, :-scale_bytes], sum(sizes))
    scales = payloads[:, -scale_bytes:].clone(memory_format=torch.contiguous_format)
    return (signs * spread(scales.view(torch.float32), sizes)).mean(dim=0)


class OneBit(CommHookCompression):
    stateful = True  # error-feedback residuals and the step count

    def __init__(self, warmup_steps: int = 50) -> None:
        super().__init__()
        if warmup_steps < 0:
            raise ConfigError(f"compression.warmup_steps={warmup_steps}: must be >= 0")
        self.warmup_steps = warmup_steps
        self.step = 0  # synchronised steps so far (resumes with the residuals)
        # Residuals per parameter, unscaled, so they survive DDP re-bucketing; each is a view
        # into the flat residual of the bucket that holds the parameter now.
        self.residuals: dict[str, torch.Tensor] = {}
        self.flat: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}  # bucket -> (names, flat)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (residual, its next value)

    def end_step(self, applied: bool) -> None:
        """Keep the step's new residuals if its update was applied; else drop them."""
        if applied:
            for residual, new in self.pending:
                residual.copy_(new)
        self.pending.clear()

    def hook(self, group, bucket):
        step = self.step
        if bucket.is_last():
            self.step += 1
        if step < self.warmup_steps:
            return self.allreduce_hook(group, bucket)
        buffer = bucket.buffer()
        sizes = [p.numel() for p in bucket.parameters()]
        residual = self.bucket_residual(bucket)
        scale = self.grad_scale
        compensated = buffer + (residual if scale is None else residual * scale)
        payload, transmitted = encode(compensated, sizes)
        # What this rank's message missed, unscaled: the residual once the step is applied.
        missed = compensated - transmitted
        self.pending.append((residual, missed if scale is None else missed / scale))

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(decode_mean(fut.value(), sizes))
            return buffer

        return self.all_gather(payload, group).then(decompress)

    def bucket_residual(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The bucket's flat residual, rebuilt from the per-parameter ones for a new layout."""
        params = bucket.parameters()
        names = tuple(self.names[id(p)] for p in params)
        layout, flat = self.flat.get(bucket.index(), ((), None))
        if layout == names:
            return flat
        buffer = bucket.buffer()
        pairs = list(zip(names, params, strict=True))
        pieces = [self.residuals.get(name, torch.zeros_like(p)).reshape(-1) for name, p in pairs]
        flat = torch.cat(pieces).to(device=buffer.device, dtype=buffer.dtype)
        if flat.numel() != buffer.numel():
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
