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
  the mean absolute value; the mean of what the ranks sent is applied, and each rank keeps what
  its message missed, only where the step was applied (plain all-reduce during warm-up);
- ssp: the averaged gradients of step t - s are applied at step t, each unscaled by the loss
  scale it was computed under;
- amp: the loss is scaled before backward and the gradients unscaled before the step; a step
  with inf/NaN gradients is skipped and the scale set to `backoff` times the smaller of the
  current scale and the one the gradients carried; `growth_interval` clean steps in a row
  multiply it by `growth`.

Each rank's gradient is that of W x its samples' summed loss / the step's labelled positions,
scaled, then the ranks are averaged: the sum is the global mean's gradient, and each rank's
fp16 values have the magnitudes a real rank's have, so loss-scale overflows happen at the same
steps.

`relative_error` compares a run's update (final minus initial parameters) with the reference's
over all parameters at once; `tolerance` states the bound a cell is held to and why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from mgpu.balance.ssp import StaleSynchronous
from mgpu.compression.bf16 import Bf16
from mgpu.compression.fp16 import Fp16
from mgpu.compression.none import NoCompression
from mgpu.compression.onebit import OneBit
from mgpu.config import Job, Options
from mgpu.loss import IGNORED_LABEL
from mgpu.precision.amp import AMP
from mgpu.precision.bf16 import BF16

#: Unit roundoff of each dtype a cell computes or sends gradients in.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

Batch = tuple[torch.Tensor, torch.Tensor]


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


def initial_model(job: Job) -> torch.nn.Module:
    """The model as every rank builds it from the seed, before any step."""
    options = Options.of(job.groups())
    torch.manual_seed(job.seed)
    data = options.data
    return options.model(input_shape=data.input_shape, num_classes=data.num_classes)


def reference(job: Job, batches: list[list[list[Batch]]]) -> tuple[dict, dict, float]:
    """(initial weights, weights after the recorded steps, the steps it skipped as non-finite).

    `batches[r][t][m]` is data-parallel rank r's micro-batch m of step t."""
    options = Options.of(job.groups())
    model = initial_model(job)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters()]
    optimizer, scheduler = options.optim.build(params, job.train.steps)
    rule = Rule(options, len(batches), params)
    for step in range(len(batches[0])):
        scale = rule.scale
        grads = [rank_gradient(model, rank[step], steps_positions(batches, step), len(batches),
                               options.precision, scale) for rank in batches]
        averaged = rule.combine(grads, scale)
        applied = False
        if averaged is not None:
            grad, carried = averaged
            applied = rule.step(optimizer, params, grad, carried)
        rule.end_step(applied)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return initial, final, rule.skipped


def steps_positions(batches: list[list[list[Batch]]], step: int) -> int:
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
                  world_size: int, precision: object, scale: float) -> list[torch.Tensor]:
    """One data-parallel rank's gradient of (world size x its summed loss / positions),
    times the loss scale, accumulated over its micro-batches."""
    model.zero_grad(set_to_none=True)
    for inputs, labels in micro_batches:
        with autocast(precision):
            logits = model(inputs)
            summed = F.cross_entropy(logits.flatten(0, -2), labels.flatten(),
                                     ignore_index=IGNORED_LABEL, reduction="sum")
        (summed.float() * (world_size / positions) * scale).backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()]


class Rule:
    """How the cell's compression, balance and precision turn the ranks' gradients into the
    update, with the state they carry from step to step."""

    def __init__(self, options: Options, world_size: int, params: list) -> None:
        self.compression, self.balance = options.compression, options.balance
        self.precision = options.precision
        self.world_size = world_size
        amp = self.precision if isinstance(self.precision, AMP) else None
        self.scale = amp.init_scale if amp else 1.0
        self.growth_tracker = 0
        self.synced = 0  # synchronised steps (onebit's warm-up counts these)
        self.errors = [[torch.zeros_like(p) for p in params] for _ in range(world_size)]
        self.pending: list[list[torch.Tensor]] | None = None
        self.queue: dict[int, tuple[list[torch.Tensor], float]] = {}
        self.step_index = 0
        self.skipped: list[int] = []  # steps (from 1) whose update was skipped: non-finite
        known = (NoCompression, Fp16, Bf16, OneBit)
        if not isinstance(self.compression, known):
            raise NotImplementedError(f"no reference for {type(self.compression).__name__}")

    def combine(self, grads: list[list[torch.Tensor]], scale: float
                ) -> tuple[list[torch.Tensor], float] | None:
        """The averaged gradients this step applies and the loss scale they carry (None where
        there are none yet: ssp's first s steps)."""
        averaged = self.average(grads, scale)
        self.synced += 1
        step, self.step_index = self.step_index, self.step_index + 1
        if not isinstance(self.balance, StaleSynchronous):
            return averaged, scale
        self.queue[step] = (averaged, scale)
        return self.queue.pop(step - self.balance.staleness, None)

    def average(self, grads: list[list[torch.Tensor]], scale: float) -> list[torch.Tensor]:
        w = self.world_size
        per_param = list(zip(*grads, strict=True))
        if isinstance(self.compression, (Fp16, Bf16)):
            dtype = torch.float16 if isinstance(self.compression, Fp16) else torch.bfloat16
            return [sum_in_order([g.to(dtype) / w for g in ranks]).float() for ranks in per_param]
        if isinstance(self.compression, OneBit):
            if self.synced < self.compression.warmup_steps:
                return [sum_in_order([g / w for g in ranks]) for ranks in per_param]
            return self.onebit(grads, scale)
        return [sum_in_order([g * (1 / w) for g in ranks]) for ranks in per_param]

    def onebit(self, grads: list[list[torch.Tensor]], scale: float) -> list[torch.Tensor]:
        sent, self.pending = [], []
        for rank_grads, errors in zip(grads, self.errors, strict=True):
            compensated = [g + e * scale for g, e in zip(rank_grads, errors, strict=True)]
            signs = [torch.where(c >= 0, c.abs().mean(), -c.abs().mean()) for c in compensated]
            sent.append(signs)
            self.pending.append([(c - s) / scale for c, s in zip(compensated, signs, strict=True)])
        return [torch.stack(ranks).mean(dim=0) for ranks in zip(*sent, strict=True)]

    def step(self, optimizer: torch.optim.Optimizer, params: list, grads: list[torch.Tensor],
             carried: float) -> bool:
        """Unscale by the scale the gradients carry; skip a non-finite step; update the scale."""
        unscaled = [g * (1 / carried) for g in grads]
        finite = all(bool(torch.isfinite(g).all()) for g in unscaled)
        if finite:
            for param, grad in zip(params, unscaled, strict=True):
                param.grad = grad.to(param.dtype)
            optimizer.step()
        else:
            self.skipped.append(self.step_index)
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

    def end_step(self, applied: bool) -> None:
        if self.pending is not None and applied:
            self.errors = self.pending
        self.pending = None


def sum_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total += tensor
    return total


def relative_error(run: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                   expected: dict[str, torch.Tensor]) -> float:
    """|run's update - the reference's| / |the reference's update|, over all parameters."""
    diff = sum(float((run[k].float() - expected[k].float()).pow(2).sum()) for k in expected)
    size = sum(float((expected[k].float() - initial[k].float()).pow(2).sum()) for k in expected)
    return math.sqrt(diff / size)


def tolerance(job: Job) -> float:
    """The relative error of the update a cell is held to.

    The run and the reference compute the same quantities in different orders (another
    split of the batch over ranks, sharded or pipelined reductions), so they differ by
    rounding. A sum of n terms rounded at unit roundoff u is off by about sqrt(n) u relative
    (rounding errors of random sign); the longest sums here run over at most 1024 terms
    (hidden widths, batch x positions), and a forward, a backward and the optimizer each add
    one such error: 3 x 32 u, for the coarsest dtype the cell computes or sends gradients in.
    An error of that size in every step's update stays of that size relative to their sum.
    """
    options = Options.of(job.groups())
    dtypes = [torch.float32]
    if isinstance(options.precision, AMP):
        dtypes.append(torch.float16)
    if isinstance(options.precision, BF16):
        dtypes.append(torch.bfloat16)
    if isinstance(options.compression, Fp16):
        dtypes.append(torch.float16)
    if isinstance(options.compression, Bf16):
        dtypes.append(torch.bfloat16)
    return 3 * 32 * max(UNIT_ROUNDOFF[d] for d in dtypes)
