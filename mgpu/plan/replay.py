"""Replays of a step's parts on the meta model: what each operation allocates, from the op that
creates a storage to its free, where a count of saved tensors misses an operation's working
set (batch norm's and ReLU's gradient buffers in backward, a micro-batch's new weight
gradients beside `.grad`, a split backward's weight half re-running the recompute)."""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining._backward import (
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mgpu.loss import cross_entropy
from mgpu.parallel.recompute import recompute_activations


class Allocations(TorchDispatchMode):
    """The storages the ops run under it create, in order: (key, +bytes) when an op's output
    has a storage not seen before, (key, -bytes) when that storage is freed (its Python object
    is kept alive by torch as long as the storage itself). Storages that existed before (the
    parameters, the batch) and views of them are not counted."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self.known = {t.untyped_storage()._cdata for t in existing}
        self.live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.add(tensor.untyped_storage())
        return out

    def add(self, storage: torch.UntypedStorage) -> None:
        address = storage._cdata
        if address in self.known or address in self.live:
            return
        key, size = len(self.events), storage.nbytes()
        self.live[address] = key
        self.events.append((key, size))
        weakref.finalize(storage, self.free, address, key, size)

    def free(self, address: int, key: int, size: int) -> None:
        self.live.pop(address, None)
        self.events.append((key, -size))

    def peak(self, since: int = 0) -> int:
        """The most bytes live at once from event `since` on, over those live before it."""
        live = peak = 0
        for _, size in self.events[since:]:
            live += size
            peak = max(peak, live)
        return peak

    def change(self, since: int) -> int:
        """Bytes live now less those live at event `since`."""
        return sum(size for _, size in self.events[since:])


def step_working_set(model: nn.Module, input_shape: tuple, batch: int, recompute: str) -> float:
    """The most bytes one forward, loss and backward of the unsplit meta `model` at `batch`
    samples holds at once beyond its parameters, their gradients and the batch: saved
    activations, the operations' temporaries and the gradient buffers backward holds at once
    (batch norm's and a ReLU's backward each make activation-sized ones beside the saved
    forward), each new weight gradient until it is added into its `.grad`; each tensor from the
    op that creates its storage to its free, under `recompute` as the strategy applies it. A
    replay of the step, where a sum of saved tensors per block misses the per-operation working
    set. The gradients exist before backward, as DDP's buckets (whose views they are) do: a
    weight's new gradient is added into them and freed."""
    module = copy.deepcopy(model)
    recompute_activations(module, recompute)
    inputs = meta_batch(input_shape, batch)
    for param in module.parameters():
        param.grad = torch.zeros_like(param)
    existing = [inputs, *module.parameters(), *module.buffers(),
                *(p.grad for p in module.parameters())]
    with Allocations(existing) as allocations:
        logits = module(inputs)
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device="meta")
        allocations.known.add(labels.untyped_storage()._cdata)
        cross_entropy(logits, labels).backward()
    return float(allocations.peak())


def meta_batch(input_shape: tuple, batch: int) -> torch.Tensor:
    """A batch of `batch` samples on the meta device: token ids for a sequence model."""
    dtype = torch.long if len(input_shape) == 1 else torch.float32
    return torch.zeros(batch, *input_shape, dtype=dtype, device="meta")


def optimizer_step_transient(optim: Any, held: list) -> float:
    """The most bytes the optimizer's per-tensor loop holds at once beside the state while it
    steps (AdamW: the denominator and its scaled copy, as large as the parameter), replayed on
    a meta copy of the largest parameter `held` locally: each parameter's temporaries are freed
    before the next one's. Sharded and tensor-parallel parameters (DTensors) take this loop;
    the fused kernels plain ones take update in place."""
    largest = max(held, key=lambda h: h.numel, default=None)
    if largest is None:
        return 0.0
    param = nn.Parameter(torch.zeros(largest.numel, device="meta"))
    param.grad = torch.zeros_like(param)
    optimizer, _ = optim.build([param], 1)
    for group in optimizer.param_groups:  # torch's loop, as it runs for DTensors
        group["fused"], group["foreach"] = False, False
    optimizer.step()  # the state, made at the first step
    state = [v for v in optimizer.state[param].values() if isinstance(v, torch.Tensor)]
    with Allocations([param, param.grad, *state]) as allocations:
        optimizer.step()
    return allocations.peak() * largest.element_size / 4


@dataclass(frozen=True)
class Pass:
    """One compute action of a pipeline stage on one micro-batch: the most bytes it holds at
    once beyond what was live before it (`peak`), and what it leaves held (`change`; negative
    where it frees). `again`: its peak from the stage's second such action of a step on, where
    each new weight gradient waits beside `.grad` until it is added; the first one's gradients
    become `.grad`, which the state counts, so they are left out of `peak`."""

    peak: float
    change: float
    again: float | None = None


def stage_inputs(model: nn.Module, input_shape: tuple, samples: int, total: int
                 ) -> list[torch.Tensor]:
    """Each of `total` pipeline stages' input at `samples` samples, on the meta device: the
    batch for the first, the one before's output for the others."""
    inputs = [meta_batch(input_shape, samples)]
    with torch.no_grad():
        for stage in range(total - 1):
            inputs.append(copy.deepcopy(model).pipeline_stage(stage, total)(inputs[-1]))
    return inputs


def stage_passes(model: nn.Module, inputs: torch.Tensor, stage: int, total: int,
                 recompute: str, kinds: frozenset[str]) -> dict[str, Pass]:
    """Stage `stage` of `total` replayed as torch's PipelineStage runs it, at `inputs`'
    samples: its forward, and its backward whole (where `kinds` holds B), split (where it
    holds I or W), or both (`replay_stage`)."""
    module = copy.deepcopy(model).pipeline_stage(stage, total)
    recompute_activations(module, recompute)
    passes = {}
    for split in {kind in ("I", "W") for kind in kinds - {"F"}}:
        passes.update(replay_stage(module, inputs, stage, total, split))
    return passes


def replay_stage(module: nn.Module, inputs: torch.Tensor, stage: int, total: int, split: bool
                 ) -> dict[str, Pass]:
    """Two micro-batches in a row through `module`, stage `stage` of `total`: the forward (kept
    for its backward: the saved tensors and the output; the last stage's loss too), then the
    full backward (`stage_backward`) or, `split`, its input half and its weight half
    (`stage_backward_input`, `stage_backward_weight`; on the first stage the input half does
    nothing and the weight half runs a full backward, as torch does). What a backward was given
    is dropped when it returns, as the stage drops it; the last stage keeps each micro-batch's
    output to the step's end (the schedule merges them)."""
    first, last = stage == 0, stage == total - 1
    inputs = inputs.detach().requires_grad_(not first and inputs.is_floating_point())
    grads_of = {p: torch.zeros_like(p) for p in module.parameters()}
    with torch.no_grad():
        shape = module(inputs).shape
    # The gradient received for the output lands in a buffer allocated once; the labels come
    # with the batch.
    received = None if last else torch.zeros(shape, device="meta")
    labels = torch.zeros(shape[:-1], dtype=torch.long, device="meta") if last else None
    existing = [inputs, *module.parameters(), *module.buffers(), *grads_of.values(),
                *([labels] if last else [received])]
    found: dict[str, list[tuple[int, int]]] = {}
    retained = []

    def measure(kind: str, run, *args) -> None:
        since = len(allocations.events)
        run(*args)
        found.setdefault(kind, []).append((allocations.peak(since), allocations.change(since)))

    with Allocations(existing) as allocations:
        for micro_batch in range(2):
            for param in module.parameters():  # the first one's weight gradients become .grad
                param.grad = grads_of[param] if micro_batch else None
            held: dict[str, Any] = {"values": [] if first else [inputs]}
            measure("F", forward, module, inputs, received, labels, split, held)
            if not split:
                measure("B", full_backward, held)
            elif first:
                measure("I", lambda: None)
                measure("W", full_backward, held)
            else:
                measure("I", input_backward, held, module)
            if last:
                retained.append(held.pop("outputs"))
            if split and not first:
                measure("W", weight_backward, held, module)
    for param in module.parameters():
        param.grad = None
    made = sum(p.numel() * p.element_size() for p in module.parameters())
    return {kind: passes_of(kind, runs, made) for kind, runs in found.items()}


def forward(module: nn.Module, inputs: torch.Tensor, received: torch.Tensor | None,
            labels: torch.Tensor | None, split: bool, held: dict[str, Any]) -> None:
    """One forward, into `held`: what backward starts from (the output, or the last stage's
    loss at `labels`, beside its output) and the gradient `received` for it (none on the last
    stage), shaped as torch's stage hands them to backward."""
    outputs = module(inputs)
    if labels is None:
        held["target"], held["grads"] = (outputs,), (received,)
        return
    loss = cross_entropy(outputs, labels)
    held["outputs"], held["target"], held["grads"] = outputs, ((loss,) if split else loss), None


def full_backward(held: dict[str, Any]) -> None:
    """Weight and input gradients at once; the input's gradient is sent and dropped."""
    stage_backward(held.pop("target"), held.pop("grads"), held.pop("values"))
    detach_output(held)


def input_backward(held: dict[str, Any], module: nn.Module) -> None:
    """The input half: what the weight half needs stays in `held` (torch detaches the output,
    which frees what only the input gradient needed)."""
    _, held["groups"] = stage_backward_input(held["target"], held["grads"], held["values"],
                                             module.parameters())
    detach_output(held)


def detach_output(held: dict[str, Any]) -> None:
    """The last stage's output, kept for the schedule to merge, no longer holds the graph once
    its backward ran (torch detaches it there)."""
    if "outputs" in held:
        held["outputs"].detach_()


def weight_backward(held: dict[str, Any], module: nn.Module) -> None:
    """The weight half, from what the input half left; then the micro-batch is done."""
    stage_backward_weight(module.parameters(), held.pop("groups"))
    held.clear()


def passes_of(kind: str, runs: list[tuple[int, int]], gradients: int) -> Pass:
    """The two micro-batches' replays of one action as a `Pass`: the first action that makes
    the stage's weight gradients (B, or W when split) made them into `.grad`."""
    (peak, change), (again, _) = runs
    if kind in ("B", "W"):
        return Pass(max(0.0, peak - gradients), change - gradients, again)
    return Pass(peak, change)
