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

Activations are an estimate. Under a pipeline, each stage's actions (forward, full backward,
and a split backward's input and weight halves) are replayed on the meta model at the
micro-batch (`mgpu.plan.replay.stage_passes`), and a rank holds what its schedule's own action
order keeps in flight: each action's peak beside what the earlier ones left held. Where a
replay of whole stages does not fit (tensor parallelism beside the pipeline), and without a
pipeline, the estimate counts the tensors autograd saves in one forward of the meta model at the
local micro-batch (a view counted once, as its base), split into the blocks' share and the rest;
tensor parallelism divides what a block saves between a column-wise layer's output and a
row-wise layer's output by its degree (the norms, the residual stream and the column-wise
layers' inputs stay whole on every rank), and full recompute keeps only each block's input and
rebuilds one block's activations for the micro-batch in backward (and, on a CPU, keeps the
random-number state checkpoint saves per block and forward). Beside them: the loaded batch, and
a pipeline stage's receive buffers. Where each rank runs the whole model on its
local batch, the planner also takes the replay of the whole step (`replay.step_working_set`)
where it is larger.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mgpu.loss import cross_entropy
from mgpu.parallel import DDPOptions, FSDPOptions, ParallelPlan
from mgpu.parallel.plan import MESH_DIMS
from mgpu.pipeline import SCHEDULES, schedule_class, stage_ids, stages_per_rank
from mgpu.plan.replay import Pass


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
    #: Of each block's saved tensors, those tensor parallelism splits: saved after a
    #: column-wise layer's output and before a row-wise layer's output.
    blocks_split: list[float] = field(default_factory=list)
    #: One sample's input and label, as the loader hands them.
    sample: float = 0.0
    #: Each block's outputs of its layers that hold weights (their gradients are what a split
    #: backward's input half keeps for its weight half), and the same before and after.
    block_outputs: list[float] = field(default_factory=list)
    outputs_before: float = 0.0
    outputs_after: float = 0.0


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
    #: The batch the loader hands the step.
    batch: float = 0.0
    #: The gradients the state counts are held at the peak (FSDP beside a pipeline makes its
    #: sharded ones only after the last backward, when the activations are gone).
    grads_at_peak: bool = True

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state: the exact part."""
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> float:
        """What the device must hold at the peak: all of it, less what lives on the host."""
        state = self.state - (0 if self.grads_at_peak else self.grads)
        return (0 if self.offloaded else state) + self.activations + self.buffers + self.batch


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
    count = plan.pp * stages_per_rank(plan.pipeline.schedule)
    return [copy.deepcopy(model).pipeline_stage(s, count)
            for s in stage_ids(plan.pipeline.schedule, pp_rank, plan.pp)]


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
    attributed to its blocks (and each block's input) or to what runs before or after them; of
    a block's, also those saved inside its tensor-parallel regions (`tp_regions`)."""
    blocks = model.blocks()
    where = {"at": "before", "split": False}
    saved: dict[Any, float] = {"before": 0.0, "after": 0.0, **{i: 0.0 for i in range(len(blocks))}}
    split = [0.0] * len(blocks)
    inputs_of = [0.0] * len(blocks)
    outputs: dict[Any, float] = dict.fromkeys(["before", "after", *range(len(blocks))], 0.0)
    seen: set[int] = set()
    keep: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # A view saves no memory of its own: its base is what stays alive, counted once.
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in seen and not is_parameter(tensor):
            seen.add(id(base))
            keep.append(base)  # held, so that no later tensor takes its id
            size = base.numel() * base.element_size() / batch
            saved[where["at"]] += size
            if where["split"] and isinstance(where["at"], int):
                split[where["at"]] += size
        return tensor

    def enter(i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            where["at"] = i
            inputs_of[i] = sum(a.numel() * a.element_size() for a in args
                               if isinstance(a, torch.Tensor)) / batch
        return hook

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        where["at"] = "after"

    def weighted(module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            outputs[where["at"]] += output.numel() * output.element_size() / batch

    handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave) for b in blocks]
    handles += tp_regions(model, where)
    handles += [m.register_forward_hook(weighted) for m in model.modules()
                if next(m.children(), None) is None
                and next(m.parameters(recurse=False), None) is not None]
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
    sample = (inputs.numel() * inputs.element_size() + labels.numel() * labels.element_size())
    return Activations(saved["before"], saved["after"],
                       [saved[i] for i in range(len(blocks))], inputs_of, split, sample / batch,
                       [outputs[i] for i in range(len(blocks))], outputs["before"],
                       outputs["after"])


def tp_regions(model: nn.Module, where: dict[str, Any]) -> list[Any]:
    """Hooks that set `where["split"]` while a block runs between a column-wise layer's output
    and a row-wise layer's output, by the model's tensor-parallel plan: what is saved there
    (attention's heads, the MLP's hidden layer, the row-wise layer's input) is split over the
    tp ranks; what a column-wise layer saves of its own input is whole on each."""
    if not hasattr(model, "tp_plan"):
        return []

    def opens(module: nn.Module, args: tuple, output: Any) -> None:
        where["split"] = True

    def closes(module: nn.Module, args: tuple, output: Any) -> None:
        where["split"] = False

    handles = []
    for block in model.blocks():
        for path, style in model.tp_plan(False).items():
            layer = block.get_submodule(path)
            if isinstance(style, ColwiseParallel) and not gathered(style):
                handles.append(layer.register_forward_hook(opens))
            elif isinstance(style, RowwiseParallel):
                handles.append(layer.register_forward_hook(closes))
    return handles


def gathered(style: ColwiseParallel) -> bool:
    """A column-wise layer whose output is gathered whole (replicated) after it: what follows
    is not split."""
    return all(isinstance(layout, Replicate) for layout in style.output_layouts)


def is_parameter(tensor: torch.Tensor) -> bool:
    """A weight, or a view of one (a Linear saves its weight transposed): no activation."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def stage_blocks(count: int, stage: int, stages_total: int) -> range:
    """The blocks `keep_stage_blocks` leaves on a stage (the same even share)."""
    bounds = [round(i * count / stages_total) for i in range(stages_total + 1)]
    return range(bounds[stage], bounds[stage + 1])


class StandInStage:
    """What a torch schedule reads of its stages to lay out its actions: a stand-in, with no
    module to run and no process group."""

    def __init__(self, index: int, stages: int, rank: int, ranks: int) -> None:
        self.stage_index, self.num_stages = index, stages
        self.group_rank, self.group_size = rank, ranks
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = nn.Identity()


@functools.lru_cache(maxsize=256)
def schedule_actions(schedule: str, ranks: int, microbatches: int, rank: int
                     ) -> tuple[tuple[str, int], ...]:
    """The compute actions pipeline rank `rank` runs in one step, in order, as (kind, stage):
    F forward, B full backward, I input-gradient and W weight-gradient half of a split one.
    One stage per rank: GPipe's or 1F1B's order (2bw's driver runs 1F1B's). Several: read from
    the torch schedule's own action order (`pipeline_order`, laid out for stand-in stages; torch
    2.6's single-stage schedules have none), an overlapped forward-backward pair as its two
    parts."""
    spec = SCHEDULES[schedule]
    if spec.per_rank == 1:
        return single_stage_actions(schedule == "gpipe", ranks, microbatches, rank)
    total = ranks * spec.per_rank
    shapes = [StandInStage(s, total, rank, ranks) for s in stage_ids(schedule, rank, ranks)]
    order = schedule_class(schedule)(shapes, n_microbatches=microbatches).pipeline_order[rank]
    found = []
    for action in (a for a in order if a is not None):
        for part in action.sub_actions or (action,):
            if part.computation_type.value in ("F", "B", "I", "W"):
                found.append((part.computation_type.value, part.stage_index))
    return tuple(found)


def single_stage_actions(gpipe: bool, ranks: int, microbatches: int, rank: int
                         ) -> tuple[tuple[str, int], ...]:
    """GPipe's order (every forward, then every backward) or 1F1B's on stage `rank`: as many
    forwards as stages after it (at most m), then one forward and one backward in turn, then
    the backwards left; torch's own order for both (checked against it in the tests)."""
    if gpipe:
        return (("F", rank),) * microbatches + (("B", rank),) * microbatches
    warmup = min(microbatches, ranks - rank - 1)
    steady = (("F", rank), ("B", rank)) * (microbatches - warmup)
    return (("F", rank),) * warmup + steady + (("B", rank),) * warmup


@dataclass(frozen=True)
class StageBytes:
    """What one micro-batch of a stage holds: from its forward to the backward that frees it
    (`kept`), while its full backward runs (`extra`), and from a split backward's input half
    to its weight half (`deferred`)."""

    kept: float
    extra: float
    deferred: float


def analytic_passes(held: StageBytes) -> dict[str, Pass]:
    """`held` as each action's `Pass`: a forward keeps its stage's bytes of one micro-batch
    until the backward that frees them (a full backward, or the weight-gradient half of a
    split one, which still needs them and what the input half left for it); a backward holds
    `extra` beside them while it runs."""
    return {
        "F": Pass(held.kept, held.kept),
        "B": Pass(held.extra, -held.kept),
        "I": Pass(held.extra, held.deferred),
        "W": Pass(0.0, -(held.kept + held.deferred)),
    }


def peak_in_flight(actions: tuple[tuple[str, int], ...], passes: dict[int, dict[str, Pass]],
                   after_backward: dict[int, float], until_backward: float = 0.0) -> float:
    """The most activation bytes held at once over `actions`, each action holding its stage's
    `Pass` beside what is live (from the stage's second such action on, its `again` peak); a
    stage's first backward adds what it holds from then on until its last backward, which
    reduces its gradients (`after_backward`), and the rank's first backward ends what it held
    only until then (`until_backward`)."""
    live = peak = until_backward
    opened: set[int] = set()
    done: set[tuple[str, int]] = set()
    last = {stage: i for i, (kind, stage) in enumerate(actions) if kind in ("B", "W")}
    for i, (kind, stage) in enumerate(actions):
        step = passes[stage][kind]
        again = (kind, stage) in done and step.again is not None
        peak = max(peak, live + (step.again if again else step.peak))
        done.add((kind, stage))
        live += step.change
        if kind in ("B", "I") and stage not in opened:
            if not opened:
                live -= until_backward
            opened.add(stage)
            live += after_backward.get(stage, 0.0)
        peak = max(peak, live)
        if last.get(stage) == i:
            live -= after_backward.get(stage, 0.0)
    return peak


def boundary(acts: Activations, stage: int, stages_total: int) -> float:
    """Bytes per sample a pipeline stage takes in: its first block's input."""
    first = stage_blocks(len(acts.blocks), stage, stages_total).start
    return acts.block_inputs[min(first, len(acts.blocks) - 1)]


def block_share(acts: Activations, block: int, plan: ParallelPlan) -> float:
    """What one rank saves of a block per sample: tensor parallelism splits its regions (with
    sequence parallelism the rest too, along the sequence)."""
    split = acts.blocks_split[block] if acts.blocks_split else acts.blocks[block]
    if plan.sequence_parallel:
        split = acts.blocks[block]
    return split / plan.tp + acts.blocks[block] - split


def stage_activations(acts: Activations, plan: ParallelPlan, stage: int, stages_total: int
                      ) -> StageBytes:
    """Per sample, what a stage holds (`StageBytes`): from forward to backward its saved
    tensors (under a pipeline its output too, which the schedule holds for the gradient it will
    receive; under full recompute each block's input only); while a full backward runs, the
    one block recompute rebuilds at a time; from a split backward's input half to its weight
    half, the gradients of its weight-holding layers' outputs, and under recompute every block
    rebuilt (the graph is kept for the weight half)."""
    first, last = stage == 0, stage == stages_total - 1
    mine = stage_blocks(len(acts.blocks), stage, stages_total)
    inner = [block_share(acts, i, plan) for i in mine]
    deferred = (sum(acts.block_outputs[i] for i in mine) + acts.outputs_before * first
                + acts.outputs_after * last)
    if plan.activation_checkpointing == "none":
        kept, extra = sum(inner), 0.0
    else:
        kept, extra = sum(acts.block_inputs[i] for i in mine), max(inner, default=0.0)
        deferred += sum(inner)
    kept += acts.before * first + acts.after * last
    if not last:
        kept += boundary(acts, stage + 1, stages_total)
    return StageBytes(kept, extra, deferred)


def activation_bytes(
    acts: Activations, plan: ParallelPlan, rank: int, local_batch: int, element_ratio: float,
    after_backward: dict[int, float] | None = None,
    replayed: dict[int, dict[str, Pass]] | None = None, until_backward: float = 0.0,
    rng_state: float = 0.0,
) -> float:
    """Activation bytes `rank` holds at its peak; `element_ratio`: the compute dtype's bytes
    over fp32's (autocast saves most activations in it); `after_backward`: per stage, what it
    holds besides from its first backward on (`unsharded_after_backward`), counted at the same
    peak; `replayed`: per stage of a pipeline rank, its actions replayed on the meta model at
    the micro-batch (`stage_passes`), which stand for the count of saved tensors;
    `until_backward`: what the rank holds until its first backward; `rng_state`: what each
    checkpointed block's forward keeps to its backward beside them (`saved_rng_state`)."""
    if plan.pipeline is None:
        ids, total, samples, actions = [0], 1, local_batch, (("F", 0), ("B", 0))
    else:
        schedule, m = plan.pipeline.schedule, plan.pipeline.microbatches
        pp_rank = coordinates(plan, rank)["pp"]
        ids = stage_ids(schedule, pp_rank, plan.pp)
        total, samples = plan.pp * stages_per_rank(schedule), local_batch // m
        actions = schedule_actions(schedule, plan.pp, m, pp_rank)
    passes = {}
    for stage in ids:
        if replayed is not None:
            passes[stage] = {kind: scaled(step, element_ratio)
                             for kind, step in replayed[stage].items()}
        else:
            per_sample = stage_activations(acts, plan, stage, total)
            scale = samples * element_ratio
            passes[stage] = analytic_passes(StageBytes(
                per_sample.kept * scale, per_sample.extra * scale, per_sample.deferred * scale))
        blocks = len(stage_blocks(len(acts.blocks), stage, total))
        passes[stage] = holding(passes[stage], blocks * rng_state)
        if total > plan.pp:
            sent = sent_per_micro_batch(acts, ids, stage, total) * samples * element_ratio
            passes[stage] = keeping_sends(passes[stage], sent)
    return peak_in_flight(actions, passes, after_backward or {}, until_backward)


def sent_per_micro_batch(acts: Activations, held: list[int], stage: int, total: int) -> float:
    """Bytes per sample stage `stage` sends to another rank for each micro-batch: its output
    forward (unless the next stage is on the same rank, `held`, or it is the last) and its
    input's gradient backward (unless the stage before is held, or it is the first)."""
    output = boundary(acts, stage + 1, total) if stage + 1 < total and stage + 1 not in held else 0
    grad = boundary(acts, stage, total) if stage > 0 and stage - 1 not in held else 0
    return output + grad


def keeping_sends(passes: dict[str, Pass], sent: float) -> dict[str, Pass]:
    """A stage's passes under a schedule of several stages per rank: torch's runtime for those
    waits for its sends only at the step's end, so what a micro-batch sent (its output, which
    its backward would otherwise free, and its input's gradient) stays held until then."""
    return {kind: shifted(step, change=sent) if kind in ("B", "I") else step
            for kind, step in passes.items()}


def holding(passes: dict[str, Pass], kept: float) -> dict[str, Pass]:
    """A stage's passes where each forward also keeps `kept` bytes until the backward that
    ends its micro-batch (a full backward, or a split one's weight half)."""
    found = {kind: shifted(step, change=-kept) if kind in ("B", "W") else step
             for kind, step in passes.items()}
    found["F"] = shifted(passes["F"], peak=kept, change=kept)
    return found


def shifted(step: Pass, peak: float = 0.0, change: float = 0.0) -> Pass:
    """`step` holding `peak` bytes more at its peak and leaving `change` bytes more held."""
    return Pass(step.peak + peak, step.change + change, step.again)


def saved_rng_state(recompute: str, device_type: str) -> float:
    """Bytes torch's checkpoint keeps per checkpointed block from its forward to its
    recompute: the CPU random-number generator's state (so that dropout draws alike in both).
    It lives in host memory, which is the device's only on a CPU."""
    if recompute == "none" or device_type != "cpu":
        return 0.0
    return float(torch.get_rng_state().nbytes)


def scaled(step: Pass, ratio: float) -> Pass:
    """`step`'s bytes in a compute dtype `ratio` times fp32's size."""
    again = None if step.again is None else step.again * ratio
    return Pass(step.peak * ratio, step.change * ratio, again)


def unsharded_after_backward(model: nn.Module, plan: ParallelPlan, rank: int,
                             compute_size: int) -> dict[int, float]:
    """Per stage of a pipeline rank under FSDP: its parameters gathered (in the compute dtype)
    and its gradients unsharded, held from the stage's first backward to its last. torch's
    pipeline stages turn off FSDP's resharding after backward and its gradient reduce-scatter
    until the last micro-batch (`backward_maybe_with_nosync`, then `perform_reduce_grad`). Over
    one dp_shard rank the gradients are those the state counts, but FSDP still makes the
    unsharded parameters a copy of their own."""
    fsdp = isinstance(plan.data_parallel, FSDPOptions)
    if plan.pipeline is None or not fsdp:
        return {}
    grad_size = 0 if plan.dp_shard == 1 else 1
    pp_rank = coordinates(plan, rank)["pp"]
    found = {}
    for stage, module in zip(stage_ids(plan.pipeline.schedule, pp_rank, plan.pp),
                             stages(model, plan, pp_rank), strict=True):
        split = tp_split_dims(module, plan)
        found[stage] = sum(p.numel() / (plan.tp if name in split else 1)
                           * (compute_size + grad_size * p.element_size())
                           for name, p in module.named_parameters())
    return found


def pipeline_buffers(acts: Activations, plan: ParallelPlan, rank: int, local_batch: int
                     ) -> float:
    """The receive buffers torch's PipelineStage allocates once, one per micro-batch: a
    stage's input (all stages but the first) and its output's gradient (all but the last)."""
    if plan.pipeline is None:
        return 0.0
    schedule, m = plan.pipeline.schedule, plan.pipeline.microbatches
    total = plan.pp * stages_per_rank(schedule)
    per_sample = 0.0
    for stage in stage_ids(schedule, coordinates(plan, rank)["pp"], plan.pp):
        if stage > 0:
            per_sample += boundary(acts, stage, total)
        if stage < total - 1:
            per_sample += boundary(acts, stage + 1, total)
    return per_sample * (local_batch // m) * m


def buffer_bytes(
    model: nn.Module, plan: ParallelPlan, rank: int, param_bytes: int, compute_size: int,
    bucket_view: bool, gloo: bool,
) -> float:
    """Communication buffers: DDP's gradient buckets, as large as the parameters, where the
    gradients are not views of them (`bucket_view`; where they are, the state's gradients are
    the buckets: each step's zero_grad drops the views, the buckets stay, and backward adds
    each new gradient into them); FSDP's gathered parameters, in the compute dtype
    (`fsdp_gathered`)."""
    if isinstance(plan.data_parallel, DDPOptions):
        return 0.0 if bucket_view else float(param_bytes)
    if not isinstance(plan.data_parallel, FSDPOptions):
        return 0.0
    return fsdp_gathered(model, plan, rank, gloo) / plan.tp * compute_size


def fsdp_gathered(model: nn.Module, plan: ParallelPlan, rank: int, gloo: bool) -> float:
    """Elements FSDP holds gathered at a step's peak. Beside a pipeline: the block being
    gathered and the next one (from the first backward on, `unsharded_after_backward`). Without
    one: the root's parameters (those of no block: gathered at forward's start, resharded after
    backward), and either every block (not resharded after forward) or, at most, a block and
    its neighbour, the next one forward or backward prefetches, which gloo gathers into a
    buffer of its own before copying it into FSDP's (`gloo`)."""
    at = coordinates(plan, rank)
    held = stages(model, plan, at["pp"])
    sizes = [sum(p.numel() for p in block.parameters())
             for module in held for block in module.blocks()]
    largest = max(sizes, default=0)
    if plan.pipeline is not None:
        return 2.0 * largest
    root = sum(p.numel() for module in held for p in module.parameters()) - sum(sizes)
    if not plan.data_parallel.reshard_after_forward:
        return float(root + sum(sizes))
    prefetched = 2 if gloo else 1
    pairs = [max(a + prefetched * b, b + prefetched * a)
             for a, b in zip(sizes, sizes[1:], strict=False)]
    return float(root + max(pairs, default=largest))
