"""1-bit sign compression with error feedback: the idea behind 1-bit Adam.

Each rank adds its residual to the gradient bucket and compresses it: the signs packed 8 per
byte plus one fp32 scale per parameter (the mean absolute value of its values); it keeps as its
new residual what that missed (worker-side error feedback). How the messages are averaged
depends on the world size W, chosen when the hook is registered and logged:

- W <= 2: every rank's whole message goes to every other by all_gather, and each rank decodes
  them all and takes the mean. A rank sends (W - 1) x N/8 bytes for N values: 1/32 of the fp32
  all-reduce's 2 (W - 1)/W x 4N at W = 2, but ever less saved as W grows.
- W > 2: a compressed all-reduce. Each parameter's values are cut into W chunks and rank j owns
  chunk j of every parameter: the messages' chunks go to their owners by all_to_all, each owner
  averages what it got, adds its own (server-side) residual, compresses the average again (one
  scale per parameter chunk) and keeps what that missed; the compressed averages come back to
  every rank by all_gather. A rank sends 2 (W - 1)/W x N/8 bytes: 1/32 at any W.

Every rank decodes the same compressed averages, so all ranks apply the same update.

Under balance=ssp the exchange of step t is applied at step t + s: its residuals are kept then,
if that update is applied, so a step's message is formed with the residuals of the exchanges
already applied (s + 1 interleaved error-feedback sequences; s = 0 is onebit alone). There the
exchange is the all_gather at any W: the compressed all-reduce's second collective starts when
its first completes, an order ranks a step apart do not share (their collectives would pair
wrongly). Checkpoints hold the residuals of the exchanges in flight with the rest.

A scale per parameter, not per bucket: which bucket a parameter lands in is DDP's choice (its
bucket size, and the rebuild after the first step of every run, resumed ones too), so with a
scale per bucket the update would depend on it; per parameter, a resumed run computes exactly
what the uninterrupted one did.

Residuals are kept in unscaled units (under amp the gradients arrive multiplied by the loss
scale, which changes between steps), and a step's new residuals are kept only if its optimizer
step was applied: a skipped non-finite step leaves them as they were, instead of an inf or NaN
that would poison every later step. Both are checkpointed by parameter name; the server-side
ones belong to chunk owners, so a run resumed at another world size starts them at zero (said
in one log line): its chunks are cut differently, and a chunk's residual means nothing to a
rank owning another range of values.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from mgpu.compression.commhook import CommHookCompression
from mgpu.errors import ConfigError

log = logging.getLogger("mgpu.compression")

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


def scaled_signs(compensated: torch.Tensor, sizes: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(one fp32 scale per parameter: its mean absolute value, the value the signs and scales
    stand for) for a bucket whose parameters have `sizes` values each."""
    scales = torch.stack([piece.abs().mean() for piece in compensated.split(sizes)])
    scales = scales.to(torch.float32)
    values = spread(scales, sizes).to(compensated.dtype)
    return scales, torch.where(compensated >= 0, values, -values)


def message(compensated: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A rank's whole message: packed signs + one fp32 scale per parameter (4 bytes each)."""
    return torch.cat([pack_signs(compensated), scales.view(torch.uint8)])


def encode(compensated: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, transmitted): the message of a bucket, and the value it stands for."""
    scales, transmitted = scaled_signs(compensated, sizes)
    return message(compensated, scales), transmitted


def decode_chunks(gathered: torch.Tensor, sizes: list[int], widths: list[int]) -> torch.Tensor:
    """The bucket from every owner's compressed average (row j: chunk j of every parameter,
    packed signs then one scale per parameter chunk)."""
    world = gathered.shape[0]
    scales = gathered[:, -4 * len(sizes):].clone(memory_format=torch.contiguous_format)
    scales = scales.view(torch.float32)  # (world, params)
    offsets = [0, *torch.tensor(widths).cumsum(0).tolist()]
    values = []
    for p, numel in enumerate(sizes):
        width = chunk_width(numel, world)
        signs = unpack_signs(gathered[:, offsets[p] : offsets[p + 1]], width)  # (world, width)
        values.append((signs * scales[:, p : p + 1]).reshape(-1)[:numel])
    return torch.cat(values)


def decode_mean(payloads: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The mean over ranks (rows of `payloads`) of each rank's scales x signs."""
    scale_bytes = 4 * len(sizes)
    signs = unpack_signs(payloads[:, :-scale_bytes], sum(sizes))
    scales = payloads[:, -scale_bytes:].clone(memory_format=torch.contiguous_format)
    return (signs * spread(scales.view(torch.float32), sizes)).mean(dim=0)


def chunk_width(numel: int, world_size: int) -> int:
    """Values per chunk where `numel` values are cut into `world_size` chunks (the last ones
    shorter, or empty)."""
    return -(-numel // world_size)


def chunk_range(numel: int, world_size: int, owner: int) -> tuple[int, int]:
    """[start, end) of chunk `owner` of `numel` values."""
    width = chunk_width(numel, world_size)
    return min(owner * width, numel), min((owner + 1) * width, numel)


def pack_chunks(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """The signs of `values` cut into `world_size` chunks: one row of packed bytes per chunk,
    every row as long (padding values count as +)."""
    width = chunk_width(values.numel(), world_size)
    padded = torch.nn.functional.pad(values.reshape(-1), (0, world_size * width - values.numel()))
    return torch.stack([pack_signs(row) for row in padded.view(world_size, width)])


def signed_scales(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the scale, what values stand for once compressed): the mean absolute value, with each
    value's sign. An empty chunk has scale 0."""
    scale = values.abs().mean() if values.numel() else values.new_zeros(())
    return scale.float(), torch.where(values >= 0, scale, -scale).to(values.dtype)


def copied(entry: tuple) -> tuple:
    """A pending residual entry with its tensors copied."""
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in entry)


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
        # Server-side residuals of the parameter chunks this rank owns (W > 2), unscaled.
        self.server: dict[str, torch.Tensor] = {}
        # step -> (kind, name, what its exchange missed, the residual it was formed with), kind
        # "residuals" (worker side) or "server", unscaled: the residual's next value once that
        # step's update is applied, or (under ssp; else None) if it is not
        self.pending: dict[int, list[tuple[str, str, torch.Tensor, torch.Tensor | None]]] = {}
        self.all_to_all_path = False  # compressed all-reduce (W > 2), else all_gather

    def comm_hook(self, model):
        hook = super().comm_hook(model)
        self.all_to_all_path = self.world_size > 2
        log.info("compression=onebit at world size %d: %s", self.world_size,
                 "compressed all-reduce (all_to_all to chunk owners, all_gather of their "
                 "compressed averages)" if self.all_to_all_path else
                 "all_gather of every rank's message (as few bytes, one round)")
        return hook

    def applied_after(self, steps: int) -> None:
        """Under ssp: the residuals of a step's exchange are kept `steps` steps later; the
        exchange is one collective, the all_gather, at any world size: the compressed
        all-reduce starts its second collective from the first one's completion, which ranks
        a step apart reach in different orders (their collectives would then pair wrongly)."""
        super().applied_after(steps)
        if self.all_to_all_path:
            self.all_to_all_path = False
            log.info("compression=onebit at world size %d under balance=ssp: all_gather of "
                     "every rank's message (one collective per bucket, launched in the hook)",
                     self.world_size)

    def end_step(self, applied: bool) -> None:
        """Keep the new residuals of the exchange this step applied (its own; under ssp the one
        `delay` steps older) if its update was applied. Else its message was never applied, so
        what it was formed with is due again: the residuals as they are (its own step), or as
        they were when it was formed (ssp: those of later exchanges belong to them)."""
        for kind, name, new, used in self.pending.pop(self.step - 1 - self.delay, []):
            residual = getattr(self, kind)[name]
            if applied:
                residual.copy_(new.view_as(residual))
            elif used is not None:
                residual.copy_(used.view_as(residual))

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
        scales, transmitted = scaled_signs(compensated, sizes)
        # What this rank's message missed, unscaled: the residual once the step is applied.
        names = [self.names[id(p)] for p in bucket.parameters()]
        missed = (compensated - transmitted).split(sizes)
        used = residual.split(sizes) if self.delay else [None] * len(names)
        for name, piece, before in zip(names, missed, used, strict=True):
            self.keep_missed(step, "residuals", name, piece, before)
        if self.all_to_all_path:
            return self.compressed_all_reduce(group, bucket, compensated, sizes, scales, step)
        payload = message(compensated, scales)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(decode_mean(fut.value(), sizes))
            return buffer

        return self.all_gather(payload, group).then(decompress)

    def keep_missed(self, step: int, kind: str, name: str, missed: torch.Tensor,
                    used: torch.Tensor | None = None) -> None:
        """`missed` (scaled as this step's gradients) becomes residual `name` of `kind` once
        the update of `step`'s exchange is applied; `used` (unscaled, copied here), the
        residual it was formed with, where that update may come after other exchanges."""
        scale = self.grad_scale
        new = missed if scale is None else missed / scale
        kept = (kind, name, new, None if used is None else used.clone())
        self.pending.setdefault(step, []).append(kept)

    def compressed_all_reduce(self, group, bucket: dist.GradBucket, compensated: torch.Tensor,
                              sizes: list[int], scales: torch.Tensor, step: int
                              ) -> torch.futures.Future:
        """The messages' chunks to their owners (all_to_all), each owner's compressed average
        of its chunks back to every rank (all_gather), decoded into the bucket. `scales`: this
        rank's scale of each parameter, which every owner needs with its chunk."""
        world, names = group.size(), [self.names[id(p)] for p in bucket.parameters()]
        rows = [pack_chunks(piece, world) for piece in compensated.split(sizes)]
        scale_bytes = scales.view(torch.uint8).expand(world, -1)
        messages = torch.cat([*rows, scale_bytes], dim=1).contiguous()
        widths = [row.shape[1] for row in rows]
        buffer = bucket.buffer()

        def average_and_gather(fut: torch.futures.Future) -> torch.Tensor:
            received = fut.value()  # (world, message bytes): this rank's chunks from each rank
            averages = self.server_step(received, names, sizes, widths, group.rank(), world,
                                        step)
            gathered = self.all_gather(averages, group).wait()
            buffer.copy_(decode_chunks(gathered, sizes, widths))
            return buffer

        return self.all_to_all(messages, group).then(average_and_gather)

    def server_step(self, received: torch.Tensor, names: list[str], sizes: list[int],
                    widths: list[int], owner: int, world: int, step: int) -> torch.Tensor:
        """Average this rank's chunk of every parameter over the ranks' messages, add its
        server residual, compress again: the packed signs and one scale per chunk."""
        senders = received[:, -4 * len(sizes):].clone(memory_format=torch.contiguous_format)
        senders = senders.view(torch.float32)  # (world, params)
        offsets = [0, *torch.tensor(widths).cumsum(0).tolist()]
        signs, chunk_scales = [], []
        for p, (name, numel) in enumerate(zip(names, sizes, strict=True)):
            start, end = chunk_range(numel, world, owner)
            width = chunk_width(numel, world)
            sent = unpack_signs(received[:, offsets[p] : offsets[p + 1]], width)[:, : end - start]
            average = (sent * senders[:, p : p + 1]).mean(dim=0)
            residual = self.server_residual(name, end - start, average)
            scale = self.grad_scale
            compensated = average + (residual if scale is None else residual * scale)
            chunk_scale, transmitted = signed_scales(compensated)
            self.keep_missed(step, "server", name, compensated - transmitted)
            padded = torch.nn.functional.pad(compensated, (0, width - (end - start)))
            signs.append(pack_signs(padded))
            chunk_scales.append(chunk_scale)
        return torch.cat([*signs, torch.stack(chunk_scales).view(torch.uint8)])

    def server_residual(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        if name not in self.server:
            self.server[name] = torch.zeros(numel, dtype=like.dtype, device=like.device)
        return self.server[name]

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
        """This rank's residuals by parameter name: its own (worker side) and those of the
        chunks it owns (server side, at this world size), and the step count (for
        `warmup_steps`)."""
        return {"step": self.step, "world_size": self.world_size,
                "residuals": {n: r.clone() for n, r in self.residuals.items()},
                "server": {n: r.clone() for n, r in self.server.items()},
                "pending": {step: [copied(entry) for entry in kept]
                            for step, kept in self.pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        if "residuals" not in state:  # saved with another compression: start as a fresh run
            log.info("compression=onebit: the checkpoint holds no state of it (saved with "
                     "another compression): residuals start at zero, warm-up at step 0")
            return
        self.step = state["step"]
        self.residuals = {n: r.clone() for n, r in state["residuals"].items()}
        # Under ssp: what the exchanges in flight missed, kept once their updates apply.
        self.pending = {step: [copied(entry) for entry in kept]
                        for step, kept in state.get("pending", {}).items()}
        self.flat = {}
        saved_world = state.get("world_size", self.world_size)
        if saved_world == self.world_size:
            self.server = {n: r.clone() for n, r in state.get("server", {}).items()}
        elif state.get("server"):
            log.info("compression=onebit: server-side residuals start at zero (saved at world "
                     "size %d, now %d: the chunks each rank owns are cut differently)",
                     saved_world, self.world_size)
            self.server = {}
