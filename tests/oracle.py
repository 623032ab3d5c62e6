"""A single-process reference of the update a run computes: the matrix tier's oracle.

The reference is written from the definitions, not from mgpu's code paths: it builds the model
from the seed, and for every step takes the micro-batches each data-parallel rank read
(recorded by the run), computes each rank's gradient of the global mean loss — every labelled
position of the step weighted alike, whatever the split — and combines them by the rule the
cell's options state:

- exact cells (no compression, a balance that only splits the batch): the mean of the ranks'
  gradients, which is the gradient of the concatenated global batch;
- fp16/bf16 on the wire: each rank's gradient rounded to that dtype, divided by the world
  size and summed in it;
- onebit: per rank and parameter, the gradient plus its error memory, sent as its signs times
  the mean absolute value; each rank keeps what its message missed (plain all-reduce during
  warm-up). On two ranks the mean of the messages is applied. On more, that mean is cut into
  W contiguous chunks per parameter, and each chunk plus its own (server) error memory is
  compressed the same way again, keeping what that missed: the compressed chunks are applied;
- PowerSGD: per matrix, P = sum over ranks of (gradient + error) Q, orthogonalised, then
  Q = the mean of (gradient + error)^T P, and P Q^T is applied; vectors and matrices not worth
  compressing are averaged plainly (with error feedback too); Q warm-starts from the last step
  (plain all-reduce before `start_powerSGD_iter`);
- ssp: the averaged gradients of step t - s are applied at step t, each unscaled by the loss
  scale it was computed under. With onebit, step t's messages are formed from the gradient
  plus the error memory as it is at step t; when step t's average is applied (at step t + s)
  the memory becomes what they missed, or, where that step is skipped, the memory they were
  formed with (their input was never applied): s + 1 interleaved error-feedback sequences.
  Every rank applies the mean of the messages at any world size (no second compression by
  chunk owners). With PowerSGD the same holds for the error memory, and its warm-start Q and
  random draws are kept per lane: s + 1 of them, step t on lane t mod (s + 1), each drawing
  its first Q from its own generator (seeded as torch's state is);
- a stale pipeline schedule (PipeDream-2BW): step t's gradient is taken at the weights before
  step t - 1, W(t+1) = W(t) - lr·∇f(W(t-1)), the initial weights standing for W(-1);
- amp: the loss is scaled before backward and the gradients unscaled before the step; a step
  with inf/NaN gradients is skipped and the scale set to `backoff` times the smaller of the
  current scale and the one the gradients carried; `growth_interval` clean steps in a row
  multiply it by `growth`. Error memories are kept unscaled and only where the step applied.

Each rank's gradient is that of W x its samples' summed loss / the step's labelled positions,
scaled, then the ranks are averaged: the sum is the global mean's gradient, and each rank's
fp16 values have the magnitudes a real rank's have, so loss-scale overflows happen at the same
steps. Where a sharded strategy computes in the precision's parameter dtype (FSDP's mixed
precision), so does the reference, each micro-batch's gradient taken to fp32 before it is
accumulated; batch norms stay fp32 there, as the FSDP layout keeps them (batch_norm refuses
low-precision weights beside its fp32 running statistics).

What the reference takes from the run besides the batches: PowerSGD's bucket layout (which
parameters DDP put in which bucket, in which order), which decides the random initial Q drawn
per bucket. Everything else follows from the config.

`relative_error` compares a run's update (final minus initial parameters) with the reference's
over all parameters at once; `tolerance` states the bound a cell is held to and why.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
from torch.nn.modules.batchnorm import _BatchNorm

from mgpu.balance.ssp import StaleSynchronous
from mgpu.compression.bf16 import Bf16
from mgpu.compression.fp16 import Fp16
from mgpu.compression.none import NoCompression
from mgpu.compression.onebit import OneBit
from mgpu.compression.powersgd import PowerSGD
from mgpu.job import Job
from mgpu.loss import IGNORED_LABEL
from mgpu.options import Options
from mgpu.parallel import FSDPOptions
from mgpu.pipeline import SCHEDULES
from mgpu.precision.amp import AMP
from mgpu.precision.bf16 import BF16

#: Unit roundoff of each dtype a cell computes or sends gradients in.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

Batch = tuple[torch.Tensor, torch.Tensor]
Grads = list[torch.Tensor]  # one per parameter, in model order


class Recorder:
    """Wraps a rank's endless micro-batch iterator and keeps the first `steps` x `accum` of
    them: what the reference computes the same steps from."""

    def __init__(self, batches: Iterator[Batch], steps: int, accum: int) -> None:
        self.batches, self.keep = batches, steps * accum
        self.accum = accum
        self.seen: list[Batch] = []

    def __iter__(self) -> Recorder:
        return self

    def __next__(self) -> Batch:
        inputs, labels = next(self.batches)
        if len(self.seen) < self.keep:
            self.seen.append((inputs.detach().cpu().clone(), labels.detach().cpu().clone()))
        return inputs, labels

    def __getattr__(self, name: str) -> object:
        """Everything else (the data position a checkpoint saves) is the wrapped loader's."""
        return getattr(self.batches, name)

    def by_step(self) -> list[list[Batch]]:
        """[step][micro-batch] -> (inputs, labels)."""
        return [self.seen[i : i + self.accum] for i in range(0, len(self.seen), self.accum)]


@dataclass
class Reference:
    initial: dict[str, torch.Tensor]  # parameters before the first step
    final: dict[str, torch.Tensor]  # parameters after the recorded steps
    skipped: list[int] = field(default_factory=list)  # steps (from 1) skipped as non-finite
    growths: int = 0  # times amp's loss scale grew


def initial_model(job: Job) -> torch.nn.Module:
    """The model as every rank builds it from the seed, before any step."""
    options = Options.of(job.groups())
    torch.manual_seed(job.seed)
    data = options.data
    return options.model(input_shape=data.input_shape, num_classes=data.num_classes)


def reference(job: Job, batches: list[list[list[Batch]]],
              buckets: list[tuple[str, ...]] | None = None) -> Reference:
    """The parameters after the recorded steps. `batches[r][t][m]` is data-parallel rank r's
    micro-batch m of step t; `buckets`, PowerSGD's bucket layout (parameter names per bucket,
    in bucket order)."""
    options = Options.of(job.groups())
    model = initial_model(job)
    names = [name for name, _ in model.named_parameters()]
    params = [p for p in model.parameters()]
    initial = {n: p.detach().clone() for n, p in zip(names, params, strict=True)}
    optimizer, scheduler = options.optim.build(params, job.train.steps)
    plan = options.strategy.plan(job.launch.world_size)
    compute_dtype = None
    if isinstance(plan.data_parallel, FSDPOptions):
        compute_dtype = options.precision.param_dtype
    pieces = plan.pipeline.microbatches if plan.pipeline else 1
    stale = plan.pipeline is not None and SCHEDULES[plan.pipeline.schedule].stale
    older = copy.deepcopy(model) if stale else None  # the weights before the last step
    rule = Rule(options, len(batches), dict(zip(names, params, strict=True)), buckets)
    for step in range(len(batches[0])):
        positions = step_positions(batches, step)
        at = older if stale else model
        grads = [rank_gradient(at, rank[step], positions, len(batches), options.precision,
                               rule.scale, compute_dtype, pieces) for rank in batches]
        if stale:
            older = copy.deepcopy(model)
        averaged = rule.combine(grads)
        applied = False
        if averaged is not None:
            applied = rule.step(optimizer, params, *averaged)
        rule.end_step(applied)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    final = {n: p.detach().clone() for n, p in zip(names, params, strict=True)}
    return Reference(initial, final, rule.skipped, rule.growths)


def step_positions(batches: list[list[list[Batch]]], step: int) -> int:
    """Labelled positions in the whole global batch of `step` (all ranks, all micro-batches)."""
    return sum(int((labels != IGNORED_LABEL).sum())
               for rank in batches for _, labels in rank[step])


def autocast(precision: object) -> object:
    if isinstance(precision, AMP):
        return torch.autocast("cpu", dtype=torch.float16)
    if isinstance(precision, BF16):
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


def rank_gradient(model: torch.nn.Module, micro_batches: list[Batch], positions: int,
                  world_size: int, precision: object, scale: float,
                  compute_dtype: torch.dtype | None, pieces: int = 1) -> Grads:
    """One data-parallel rank's gradient of (world size x its summed loss / positions), times
    the loss scale, accumulated over its micro-batches in fp32. With `compute_dtype`, each
    micro-batch runs on a copy of the weights in that dtype.

    A pipeline (`pieces` micro-batches per step) takes the mean loss of each piece, scaled,
    backward from each, and divides the sum of their gradients by `pieces`: on equal pieces
    the same gradient, with the activations' gradients `pieces` times as large (where fp16
    overflows first)."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    work = model
    if compute_dtype not in (None, torch.float32):
        work = copy.deepcopy(model).to(compute_dtype)
        for norm in (m for m in work.modules() if isinstance(m, _BatchNorm)):
            norm.float()
    for inputs, labels in micro_batches:
        for x, y in zip(inputs.tensor_split(pieces), labels.tensor_split(pieces), strict=True):
            work.zero_grad(set_to_none=True)
            with autocast(precision):
                logits = work(x)
                summed = F.cross_entropy(logits.flatten(0, -2), y.flatten(),
                                         ignore_index=IGNORED_LABEL, reduction="sum")
            if pieces == 1:
                weight = world_size / positions
            else:
                weight = world_size / (len(micro_batches) * int((y != IGNORED_LABEL).sum()))
            (summed.float() * weight * scale).backward()
            for acc, param in zip(total, work.parameters(), strict=True):
                if param.grad is not None:
                    acc += param.grad.float() / pieces
    return total


class Rule:
    """How the cell's compression, balance and precision turn the ranks' gradients into the
    update, with the state they carry from step to step."""

    def __init__(self, options: Options, world_size: int, params: dict[str, torch.Tensor],
                 buckets: list[tuple[str, ...]] | None) -> None:
        self.compression, self.balance = options.compression, options.balance
        self.precision = options.precision
        self.world_size = world_size
        self.names = list(params)
        amp = self.precision if isinstance(self.precision, AMP) else None
        self.scale = amp.init_scale if amp else 1.0
        self.growth_tracker = 0
        self.synced = 0  # synchronised steps so far (compression warm-ups count these)
        self.queue: dict[int, tuple[Grads, float]] = {}  # ssp: step -> (averaged, its scale)
        self.skipped: list[int] = []
        self.growths = 0
        # Steps between a step's exchange and the step that applies its average.
        self.delay = self.balance.staleness if isinstance(self.balance, StaleSynchronous) else 0
        # Error memories per rank (unscaled), and by step what they become once the average of
        # that step's exchange is applied or skipped: (what it missed, what it was formed with).
        self.errors = [[torch.zeros_like(p) for p in params.values()] for _ in range(world_size)]
        self.pending: dict[int, tuple[list[Grads], list[Grads]]] = {}
        # onebit's server side (W > 2): (parameter index, chunk) -> error memory (unscaled)
        self.server_errors: dict[tuple[int, int], torch.Tensor] = {}
        self.server_pending: dict[tuple[int, int], torch.Tensor] = {}
        # PowerSGD's warm-start Q and random draws: under ssp one per lane, a lane taking
        # every (s + 1)-th step (its next exchange comes after its last one was applied).
        self.lanes: list[PowerSGDReference] = []
        if isinstance(self.compression, PowerSGD):
            self.lanes = [PowerSGDReference(self.compression.settings, params, buckets)
                          for _ in range(self.delay + 1)]
        elif not isinstance(self.compression, (NoCompression, Fp16, Bf16, OneBit)):
            raise NotImplementedError(f"no reference for {type(self.compression).__name__}")

    def combine(self, grads: list[Grads]) -> tuple[Grads, float] | None:
        """The averaged gradients this step applies and the loss scale they carry (None where
        there are none yet: ssp's first s steps)."""
        averaged = self.average(grads)
        step, self.synced = self.synced, self.synced + 1
        if not isinstance(self.balance, StaleSynchronous):
            return averaged, self.scale
        self.queue[step] = (averaged, self.scale)
        return self.queue.pop(step - self.balance.staleness, None)

    def average(self, grads: list[Grads]) -> Grads:
        w = self.world_size
        per_param = list(zip(*grads, strict=True))
        if isinstance(self.compression, (Fp16, Bf16)):
            dtype = torch.float16 if isinstance(self.compression, Fp16) else torch.bfloat16
            return [sum_in_order([g.to(dtype) / w for g in ranks]).float() for ranks in per_param]
        if isinstance(self.compression, OneBit) and self.synced >= self.compression.warmup_steps:
            return self.with_error_feedback(grads, self.onebit)
        if self.lanes and self.synced >= self.lanes[0].start:
            lane = self.lanes[self.synced % len(self.lanes)]
            return self.with_error_feedback(grads, lane.average)
        if isinstance(self.compression, (OneBit, PowerSGD)):  # warm-up: torch's allreduce_hook
            return [sum_in_order([g / w for g in ranks]) for ranks in per_param]
        return [sum_in_order([g * (1 / w) for g in ranks]) for ranks in per_param]

    def with_error_feedback(self, grads: list[Grads], send) -> Grads:
        """Each rank's input is its gradient plus its error memory (scaled as the gradient
        is); `send(inputs)` gives (what every rank applies, what each rank's message stood
        for), and each rank's new memory is what its message missed of its input, unscaled."""
        inputs = [[g + e * self.scale for g, e in zip(rank, errors, strict=True)]
                  for rank, errors in zip(grads, self.errors, strict=True)]
        applied, sent = send(inputs)
        missed = [[(x - s) / self.scale for x, s in zip(rank, sent_rank, strict=True)]
                  for rank, sent_rank in zip(inputs, sent, strict=True)]
        self.pending[self.synced] = (missed, self.errors)
        return applied

    def onebit(self, inputs: list[Grads]) -> tuple[Grads, list[Grads]]:
        """Each rank's message: per parameter, the signs times the mean absolute value (a sum
        over all its values); every rank applies the mean of the messages."""
        signs = [[torch.where(x >= 0, x.abs().mean(), -x.abs().mean()) for x in rank]
                 for rank in inputs]
        means = [torch.stack(ranks).mean(dim=0) for ranks in zip(*signs, strict=True)]
        if self.world_size <= 2 or self.delay:
            return means, signs
        return [self.server_side(i, mean) for i, mean in enumerate(means)], signs

    def server_side(self, index: int, mean: torch.Tensor) -> torch.Tensor:
        """The mean message of a parameter, compressed again chunk by chunk with the chunk's
        error memory."""
        values, w = mean.reshape(-1), self.world_size
        width = -(-values.numel() // w)
        sent = []
        for chunk, piece in enumerate(values.split(width)):
            memory = self.server_errors.get((index, chunk), torch.zeros_like(piece))
            x = piece + memory * self.scale
            scale = x.abs().mean()
            sent.append(torch.where(x >= 0, scale, -scale))
            self.server_pending[index, chunk] = (x - sent[-1]) / self.scale
        return torch.cat(sent).view_as(mean)

    def step(self, optimizer: torch.optim.Optimizer, params: list, grads: Grads,
             carried: float) -> bool:
        """Unscale by the scale the gradients carry; skip a non-finite step; update the scale."""
        unscaled = [g * (1 / carried) for g in grads]
        finite = all(bool(torch.isfinite(g).all()) for g in unscaled)
        if finite:
            for param, grad in zip(params, unscaled, strict=True):
                param.grad = grad.to(param.dtype)
            optimizer.step()
        else:
            self.skipped.append(self.synced)
        if isinstance(self.precision, AMP):
            self.update_scale(finite, carried)
        return finite

    def update_scale(self, finite: bool, carried: float) -> None:
        amp = self.precision
        if not finite:
            self.scale = min(self.scale, carried) * amp.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == amp.growth_interval:
            self.scale *= amp.growth_factor
            self.growth_tracker = 0
            self.growths += 1

    def end_step(self, applied: bool) -> None:
        """The memories become what the exchange whose average this step applied (its own, or
        under ssp the one `delay` steps older) missed if the step applied; else those it was
        formed with."""
        step = self.synced - 1 - self.delay
        pending = self.pending.pop(step, None)
        if pending is not None:
            missed, used = pending
            self.errors = missed if applied else used
            if applied:
                self.server_errors.update(self.server_pending)
        self.server_pending = {}
        if self.lanes and step >= 0:
            self.lanes[step % len(self.lanes)].end_step(applied)


class PowerSGDReference:
    """torch's PowerSGD rule, matrix by matrix, with the initial Q it draws per bucket."""

    def __init__(self, settings: dict, params: dict[str, torch.Tensor],
                 buckets: list[tuple[str, ...]] | None) -> None:
        if not (settings["use_error_feedback"] and settings["warm_start"]) or buckets is None:
            raise NotImplementedError("a PowerSGD reference needs error feedback, warm start "
                                      "and the run's bucket layout")
        self.rank = settings["matrix_approximation_rank"]
        self.rate = settings["min_compression_rate"]
        self.start = settings["start_powerSGD_iter"]
        self.shapes = {name: p.shape for name, p in params.items()}
        self.buckets = buckets
        self.rng = np.random.RandomState(0)  # PowerSGDState's default random_seed
        self.q: dict[str, torch.Tensor] | None = None  # warm-start Q per compressed matrix
        self.q_before: dict[str, torch.Tensor] | None = None  # Q as it was before this step

    def matrix(self, name: str) -> tuple[int, int, int]:
        """(rows, columns, rank) of the matrix torch views a gradient as."""
        shape = self.shapes[name]
        n, m = shape[0], math.prod(shape[1:])
        return n, m, min(n, m, self.rank)

    def compressed(self, name: str) -> bool:
        n, m, r = self.matrix(name)
        return (n + m) * r * self.rate < n * m

    def draw(self) -> dict[str, torch.Tensor]:
        """Random orthogonal Q per compressed matrix: one seed per bucket, drawn in bucket
        order; within a bucket, matrices grouped by shape (first appearance), bucket order."""
        q = {}
        for names in self.buckets:
            groups: dict[tuple[int, int], list[str]] = {}
            for name in filter(self.compressed, names):
                groups.setdefault(self.matrix(name)[:2], []).append(name)
            seed = self.rng.randint(1_000_000_000)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for name in (name for group in groups.values() for name in group):
                    _, m, r = self.matrix(name)
                    q[name] = torch.randn(1, m, r)
                    _orthogonalize(q[name], 0)
        return q

    def average(self, inputs: list[Grads]) -> tuple[Grads, list[Grads]]:
        """What every rank applies: the rank-r approximation of the mean of the inputs per
        compressed matrix, the plain mean elsewhere."""
        self.q_before = None if self.q is None else {n: q.clone() for n, q in self.q.items()}
        if self.q is None:
            self.q = self.draw()
        else:
            for q in self.q.values():
                _orthogonalize(q, 0)
        w = len(inputs)
        applied = []
        for name, values in zip(self.shapes, zip(*inputs, strict=True), strict=True):
            if not self.compressed(name):
                applied.append(sum_in_order(list(values)) / w)
                continue
            n, m, _ = self.matrix(name)
            matrices = [x.reshape(1, n, m) for x in values]
            p = sum_in_order([torch.bmm(x, self.q[name]) for x in matrices])
            _orthogonalize(p, 0)
            q = sum_in_order([torch.bmm(x.transpose(1, 2), p) for x in matrices]) / w
            self.q[name] = q
            applied.append(torch.bmm(p, q.transpose(1, 2)).reshape(self.shapes[name]))
        return applied, [applied] * w

    def end_step(self, applied: bool) -> None:
        """A skipped step leaves Q as it was (before the first, none: drawn anew)."""
        if not applied:
            self.q = self.q_before


def sum_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total += tensor
    return total


def relative_error(run: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                   expected: dict[str, torch.Tensor]) -> float:
    """|run's update - the reference's| / |the reference's update|, over all parameters of
    `expected`."""
    diff = sum(float((run[k].float() - expected[k].float()).pow(2).sum()) for k in expected)
    size = sum(float((expected[k].float() - initial[k].float()).pow(2).sum()) for k in expected)
    return math.sqrt(diff / size)


def tolerance(job: Job, batches: list[list[list[Batch]]]) -> float:
    """The relative error of the update a cell is held to: (2 d + 1)(3 u + sqrt(n) u32).

    The run and the reference compute the same quantities in different orders (another split
    of the batch over ranks, sharded or pipelined reductions, another summation order) and
    round differently. Each of the d matrix products between input and loss rounds once
    forward and once backward, the update once more: 2 d + 1 stages. At each, the operands and
    the result are rounded to the coarsest dtype the cell computes or sends gradients in (3 u,
    u its unit roundoff), and the sum inside is accumulated in fp32 (on CPU and GPU alike): a
    sum of n terms is off by about sqrt(n) u32 relative (rounding errors of random sign), n
    the longest sum of the cell (the largest fan-in, the labelled positions of a step,
    onebit's mean over a whole parameter). An error of that size in every step's update stays
    of that size relative to their sum. fp32 cells: u = u32.
    """
    options = Options.of(job.groups())
    dtypes = [torch.float32]
    if isinstance(options.precision, (AMP, BF16)):
        dtypes.append(options.precision.param_dtype)
    if isinstance(options.compression, Fp16):
        dtypes.append(torch.float16)
    if isinstance(options.compression, Bf16):
        dtypes.append(torch.bfloat16)
    params = list(initial_model(job).parameters())
    depth = sum(p.dim() >= 2 for p in params)
    longest = max(max(p.numel() // p.shape[0] for p in params),
                  *(step_positions(batches, step) for step in range(len(batches[0]))))
    if isinstance(options.compression, OneBit):
        longest = max(longest, *(p.numel() for p in params))
    u32, coarsest = UNIT_ROUNDOFF[torch.float32], max(UNIT_ROUNDOFF[d] for d in dtypes)
    return (2 * depth + 1) * (3 * coarsest + math.sqrt(longest) * u32)
