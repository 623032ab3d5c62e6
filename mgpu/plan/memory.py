"""Memory per rank of a layout, from the model built on the meta device (nothing allocated).

Parameters, gradients and optimizer state are counted exactly, tensor by tensor, as each
layout places them: a pipeline rank holds its stages (the model's own `pipeline_stage` cuts a
meta copy), tensor parallelism splits the weights the model's `tp_plan` names (column-wise:
dim 0 of a Linear's weight and bias; row-wise: dim 1 of the weight), FSDP2 splits dim 0 of
what is left over its dp_shard ranks, and ZeRO-1 gives each rank the optimizer state of the
parameters ZeroRedundancyOptimizer's greedy partition gives it. Shards follow torch's chunking
(`ceil(n / parts)` rows per rank, the last ones fewer or none), which is what a DTensor's local
tensor holds. The optimizer's state per parameter comes from the configured optimizer itself,
stepped once on a small parameter (AdamW: two tensors like the parameter and a scalar step;
SGD: one momentum buffer, none at momentum 0).

Activations are an estimate: the tensors autograd saves for backward in one forward of the meta
model at the local micro-batch (a view counted once, as its base), split into the blocks' share
and the rest; tensor parallelism divides the blocks' share by its degree, full recompute keeps
only each block's input plus one block's activations, and a pipeline stage
holds as many micro-batches as its schedule keeps in flight.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mgpu.loss import cross_entropy
from mgpu.parallel import DDPOptions, FSDPOptions, ParallelPlan
from mgpu.parallel.plan import MESH_DIMS
from mgpu.pipeline import stages_per_rank


@dataclass(frozen=True)
class Held:
    """A parameter as one rank holds it: its name, its local elements and their size."""

    name: str
    numel: int
    element_size: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class OptimizerCost:
    """Optimizer state per parameter: bytes per element of the parameter (states shaped like
    it) plus fixed bytes per parameter tensor (a scalar step count)."""

    per_element: int
    per_tensor: int

    def bytes(self, held: list[Held]) -> int:
        return sum(h.numel * self.per_element + self.per_tensor for h in held)


@dataclass(frozen=True)
class Activations:
    """Bytes autograd saves in one forward of one sample, by where they are saved."""

    #: Before the first block (embeddings) and after the last (norm, head, loss).
    before: float
    after: float
    #: Each block's saved tensors, and the bytes of each block's input.
    blocks: list[float] = field(default_factory=list)
    block_inputs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted bytes."""

    params: int
    grads: int
    optimizer: int
    activations: float
    buffers: float
    #: Parameters, gradients and optimizer state live in host memory (FSDP's cpu_offload).
    offloaded: bool = False

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state: the exact part."""
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> float:
        """What the device must hold at the peak: all of it, less what lives on the host."""
        return (0 if self.offloaded else self.state) + self.activations + self.buffers


def optimizer_cost(optim: Any) -> OptimizerCost:
    """The optimizer option's state per parameter, from one step of it on a small parameter."""
    numel = 5
    param = nn.Parameter(torch.zeros(numel))
    optimizer, _ = optim.build([param], 1)
    param.grad = torch.ones(numel)
    optimizer.step()
    per_element = per_tensor = 0
    for value in optimizer.state[param].values():
        if not isinstance(value, torch.Tensor):
            continue
        if value.numel() == numel:
            per_element += value.element_size()
        else:
            per_tensor += value.numel() * value.element_size()
    return OptimizerCost(per_element, per_tensor)


def coordinates(plan: ParallelPlan, rank: int) -> dict[str, int]:
    """`rank`'s index along each mesh dim (row-major over MESH_DIMS, tp innermost)."""
    degrees = (plan.pp, plan.dp_replicate, plan.dp_shard, plan.tp)
    index = {}
    for name, size in reversed(list(zip(MESH_DIMS, degrees, strict=True))):
        index[name] = rank % size
        rank //= size
    return index


def chunk(n: int, parts: int, index: int) -> int:
    """Rows of `n` that part `index` of `parts` holds under torch's chunking."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


def stages(model: nn.Module, plan: ParallelPlan, pp_rank: int) -> list[nn.Module]:
    """The modules a pipeline rank holds (a meta copy cut per stage), or the model itself."""
    if plan.pipeline is None:
        return [model]
    per_rank = stages_per_rank(plan.pipeline.schedule)
    count = plan.pp * per_rank
    return [copy.deepcopy(model).pipeline_stage(pp_rank + k * plan.pp, count)
            for k in range(per_rank)]


def tp_split_dims(module: nn.Module, plan: ParallelPlan) -> dict[str, int]:
    """{parameter name in `module`: the dim tensor parallelism splits} by the model's plan."""
    if plan.tp == 1:
        return {}
    dims = {}
    prefixes = {id(m): name for name, m in module.named_modules()}
    for block in module.blocks():
        for path, style in module.tp_plan(plan.sequence_parallel).items():
            layer = block.get_submodule(path)
            where = f"{prefixes[id(block)]}.{path}".strip(".")
            for param, dim in split_of(layer, style).items():
                dims[f"{where}.{param}"] = dim
    return dims


def split_of(layer: nn.Module, style: Any) -> dict[str, int]:
    """What a parallel style splits of one layer (torch's ColwiseParallel/RowwiseParallel)."""
    embedding = isinstance(layer, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return {"weight": 1} if embedding else {"weight": 0, "bias": 0}
    if isinstance(style, RowwiseParallel):
        return {"weight": 0} if embedding else {"weight": 1}
    return {}


def held_parameters(model: nn.Module, plan: ParallelPlan, rank: int) -> list[Held]:
    """Every parameter `rank` holds under `plan`, at its local size."""
    at = coordinates(plan, rank)
    held = []
    for module in stages(model, plan, at["pp"]):
        split = tp_split_dims(module, plan)
        for name, param in module.named_parameters():
            shape = list(param.shape)
            if name in split:
                dim = split[name]
                shape[dim] = chunk(shape[dim], plan.tp, at["tp"])
            if isinstance(plan.data_parallel, FSDPOptions) and shape:
                shape[0] = chunk(shape[0], plan.dp_shard, at["dp_shard"])
            held.append(Held(name, math.prod(shape), param.element_size()))
    return held


def zero_partition(held: list[Held], world: int) -> list[list[Held]]:
    """ZeroRedundancyOptimizer's partition: largest parameter first, each to the rank with the
    fewest elements so far (the lowest such rank)."""
    parts: list[list[Held]] = [[] for _ in range(world)]
    sizes = [0] * world
    for h in sorted(held, key=lambda h: h.numel, reverse=True):
        rank = sizes.index(min(sizes))
        parts[rank].append(h)
        sizes[rank] += h.numel
    return parts


def state_bytes(
    model: nn.Module, plan: ParallelPlan, rank: int, cost: OptimizerCost, zero: bool
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes `rank` holds; `zero`: the optimizer state
    is partitioned over the data-parallel ranks of whole replicas (ZeRO-1)."""
    held = held_parameters(model, plan, rank)
    params = sum(h.nbytes for h in held)
    stepped = held
    if zero and isinstance(plan.data_parallel, DDPOptions):
        stepped = zero_partition(held, plan.dp_replicate)[coordinates(plan, rank)["dp_replicate"]]
    return params, params, cost.bytes(stepped)


def saved_activations(model: nn.Module, input_shape: tuple, batch: int) -> Activations:
    """The bytes autograd saves per sample in one forward and loss of the meta `model`,
    attributed to its blocks (and each block's input) or to what runs before or after them."""
    blocks = model.blocks()
    where = {"at": "before"}
    saved: dict[Any, float] = {"before": 0.0, "after": 0.0, **{i: 0.0 for i in range(len(blocks))}}
    inputs_of = [0.0] * len(blocks)
    seen: set[int] = set()
    keep: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # A view saves no memory of its own: its base is what stays alive, counted once.
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in seen and not is_parameter(tensor):
            seen.add(id(base))
            keep.append(base)  # held, so that no later tensor takes its id
            saved[where["at"]] += base.numel() * base.element_size() / batch
        return tensor

    def enter(i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            where["at"] = i
            inputs_of[i] = sum(a.numel() * a.element_size() for a in args
                               if isinstance(a, torch.Tensor)) / batch
        return hook

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        where["at"] = "after"

    handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave) for b in blocks]
    try:
        dtype = torch.long if len(input_shape) == 1 else torch.float32
        inputs = torch.zeros(batch, *input_shape, dtype=dtype, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(inputs)
            labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device="meta")
            cross_entropy(logits, labels)
    finally:
        for handle in handles:
            handle.remove()
    return Activations(saved["before"], saved["after"],
                       [saved[i] for i in range(len(blocks))], inputs_of)


def is_parameter(tensor: torch.Tensor) -> bool:
    """A weight, or a view of one (a Linear saves its weight transposed): no activation."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def stage_blocks(count: int, stage: int, stages_total: int) -> range:
    """The blocks `keep_stage_blocks` leaves on a stage (the same even share)."""
    bounds = [round(i * count / stages_total) for i in range(stages_total + 1)]
    return range(bounds[stage], bounds[stage + 1])


def in_flight(plan: ParallelPlan, pp_rank: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at once, over all its stages: all
    of them under GPipe, and on each of its stages under the looped breadth-first schedule
    (every forward before any backward); at most its distance to the end under 1F1B (doubled,
    plus a loop, when interleaved)."""
    m = plan.pipeline.microbatches
    if plan.pipeline.schedule == "gpipe":
        return m
    if plan.pipeline.schedule == "looped_bfs":
        return m * stages_per_rank("looped_bfs")
    if plan.pipeline.schedule == "interleaved_1f1b":
        return min(2 * m, 2 * (plan.pp - pp_rank - 1) + plan.pp + 1)
    return min(m, plan.pp - pp_rank)


def activation_bytes(
    acts: Activations, plan: ParallelPlan, rank: int, local_batch: int, element_ratio: float
) -> float:
    """Activation bytes `rank` holds at its peak; `element_ratio`: the compute dtype's bytes
    over fp32's (autocast saves most activations in it)."""
    at = coordinates(plan, rank)
    count = len(acts.blocks)
    if plan.pipeline is None:
        stage_ids, total, samples = [0], 1, local_batch
    else:
        per_rank = stages_per_rank(plan.pipeline.schedule)
        total = plan.pp * per_rank
        stage_ids = [at["pp"] + k * plan.pp for k in range(per_rank)]
        samples = local_batch // plan.pipeline.microbatches * in_flight(plan, at["pp"]) / per_rank
    per_sample = 0.0
    for stage in stage_ids:
        mine = stage_blocks(count, stage, total)
        inner = [acts.blocks[i] / plan.tp for i in mine]
        if plan.activation_checkpointing == "none":
            per_sample += sum(inner)
        else:
            per_sample += sum(acts.block_inputs[i] for i in mine) + max(inner, default=0.0)
        per_sample += acts.before * (stage == 0) + acts.after * (stage == total - 1)
    return per_sample * samples * element_ratio


def buffer_bytes(
    model: nn.Module, plan: ParallelPlan, rank: int, param_bytes: int, compute_size: int
) -> float:
    """Communication buffers: DDP's gradient buckets, as large as the parameters, beside the
    gradients (even with gradient_as_bucket_view: each step's zero_grad sets gradients to None,
    so backward allocates them anew before DDP copies them into the buckets; measured on CPU,
    the step's peak holds both); FSDP's gathered block and the next one it prefetches, in the
    compute dtype."""
    if isinstance(plan.data_parallel, DDPOptions):
        return float(param_bytes)
    if not isinstance(plan.data_parallel, FSDPOptions):
        return 0.0
    at = coordinates(plan, rank)
    largest = max(
        (sum(p.numel() for p in block.parameters()) for module in stages(model, plan, at["pp"])
         for block in module.blocks()), default=0,
    )
    return 2.0 * largest / plan.tp * compute_size
