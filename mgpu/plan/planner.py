"""The planner: every candidate layout's predicted memory per rank and step time, ranked.

Pure functions of the job, its options and what is known of the machine (`Machine`): no
process group, nothing allocated (the model is built on the meta device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mgpu.monitor.mfu import flops_per_sample
from mgpu.parallel import DDPOptions, FSDPOptions, ParallelPlan
from mgpu.pipeline import stage_ids, stages_per_rank
from mgpu.plan.candidates import Candidate, candidates
from mgpu.plan.machine import Machine
from mgpu.plan.memory import (
    RankMemory,
    activation_bytes,
    buffer_bytes,
    coordinates,
    held_parameters,
    optimizer_cost,
    pipeline_buffers,
    saved_activations,
    saved_rng_state,
    schedule_actions,
    stages,
    state_bytes,
    unsharded_after_backward,
)
from mgpu.plan.replay import (
    Pass,
    optimizer_step_transient,
    stage_inputs,
    stage_passes,
    step_working_set,
)
from mgpu.plan.speed import (
    StepTime,
    bubble,
    comm_seconds,
    compute_seconds,
    data_parallel_collectives,
    pipeline_collectives,
    tp_collectives,
    tp_layers,
)

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

MIB = 2**20


@dataclass(frozen=True)
class Row:
    """One candidate's predictions: the rank that needs the most device memory, and the step."""

    candidate: Candidate
    #: Every rank's predicted memory, by rank.
    ranks: list[RankMemory]
    time: StepTime
    fits: bool

    @property
    def memory(self) -> RankMemory:
        """The rank that needs the most device memory."""
        return max(self.ranks, key=lambda m: m.device)

    @property
    def state_per_rank(self) -> list[int]:
        """Parameter + gradient + optimizer bytes of every rank, by rank."""
        return [m.state for m in self.ranks]


@dataclass(frozen=True)
class Model:
    """What the planner reads from the job's model once: the meta model and its figures."""

    module: nn.Module
    input_shape: tuple
    flops_per_sample: float
    tp_layers: list
    element_ratio: float


def meta_model(job: Job, options: Options) -> Model:
    """The job's model on the meta device (padded as its precision pads it)."""
    data = options.data
    with torch.device("meta"):
        module = options.precision.prepare(
            options.model(input_shape=data.input_shape, num_classes=data.num_classes))
    flops = flops_per_sample(options.model, data.input_shape, data.num_classes)
    compute = options.precision.param_dtype
    ratio = torch.empty((), dtype=compute).element_size() / 4
    layers = tp_layers(module, tuple(data.input_shape))
    return Model(module, tuple(data.input_shape), flops, layers, ratio)


def rank_memory(model: Model, job: Job, options: Options, candidate: Candidate, rank: int,
                acts, replays: dict[tuple, Any], machine: Machine) -> RankMemory:
    """`replays`: what the meta model's replays found (`step_working_set`, `stage_passes`), by
    what they replayed, filled as layouts ask for it."""
    plan, strategy = candidate.plan, candidate.strategy
    zero = strategy.shards_optimizer and isinstance(plan.data_parallel, DDPOptions)
    params, grads, optim = state_bytes(model.module, plan, rank, optimizer_cost(options.optim),
                                       zero)
    local_batch = job.data["batch_size"] // plan.dp // job.train.grad_accum
    compute_size = int(4 * model.element_ratio)
    fsdp = isinstance(plan.data_parallel, FSDPOptions)
    comm = buffer_bytes(model.module, plan, rank, params, compute_size,
                        options.network.gradient_as_bucket_view, machine.device_type == "cpu")
    # Beside a pipeline, FSDP gathers block by block only until the rank's first backward;
    # from then on its stages stay gathered (`unsharded_after_backward`), so of its two
    # gathered blocks the prefetched one is held only until then, and the last gather's
    # buffer until the next gather.
    gathered_whole = fsdp and plan.pipeline is not None and plan.dp_shard > 1
    prefetched = comm / 2 if gathered_whole else 0.0
    rng_state = saved_rng_state(plan.activation_checkpointing, machine.device_type)
    activations = activation_bytes(
        acts, plan, rank, local_batch, model.element_ratio,
        unsharded_after_backward(model.module, plan, rank, compute_size),
        replayed_stages(model, plan, rank, local_batch, replays), prefetched, rng_state)
    if plan.pipeline is None and plan.tp == 1:
        activations = max(activations, len(acts.blocks) * rng_state + replayed_activations(
            model, plan.activation_checkpointing, local_batch, replays))
    buffers = comm - prefetched + pipeline_buffers(acts, plan, rank, local_batch)
    # On a CPU the host's memory is the device's: offloading moves nothing out of it.
    offloaded = fsdp and plan.data_parallel.cpu_offload and machine.device_type != "cpu"
    if (plan.tp > 1 or fsdp) and not offloaded:
        # The step's peak may be in the optimizer's per-tensor loop, once backward has freed
        # the activations and FSDP its gathered blocks (DDP's buckets stay).
        step = optimizer_step_transient(options.optim, held_parameters(model.module, plan, rank))
        activations = max(activations, step - (comm if fsdp else 0.0))
    return RankMemory(params, grads, optim, activations, buffers, offloaded,
                      acts.sample * local_batch, grads_at_peak=not gathered_whole)


def replayed_activations(model: Model, recompute: str, local_batch: int,
                         replays: dict[tuple, Any]) -> float:
    """What one rank's step holds beyond its state where each rank runs the whole model on its
    local batch: the replayed step's working set (`step_working_set`). The planner takes the
    larger of this and the saved forward (`activation_bytes`): with the cnn the replay's peak
    is in backward, where batch norm's and ReLU's backward hold activation-sized buffers beside
    the saved forward."""
    key = ("step", recompute, local_batch)
    if key not in replays:
        replays[key] = step_working_set(model.module, model.input_shape, local_batch, recompute)
    return replays[key] * model.element_ratio


def replayed_stages(model: Model, plan: ParallelPlan, rank: int, local_batch: int,
                    replays: dict[tuple, Any]) -> dict[int, dict[str, Pass]] | None:
    """Each stage of a pipeline rank replayed at the micro-batch (`stage_passes`); None
    without a pipeline, or with tensor parallelism beside it (the replay runs whole stages;
    the count of saved tensors splits them)."""
    if plan.pipeline is None or plan.tp > 1:
        return None
    schedule, m = plan.pipeline.schedule, plan.pipeline.microbatches
    pp_rank = coordinates(plan, rank)["pp"]
    total, samples = plan.pp * stages_per_rank(schedule), local_batch // m
    if ("inputs", total, samples) not in replays:
        replays["inputs", total, samples] = stage_inputs(model.module, model.input_shape,
                                                        samples, total)
    actions = schedule_actions(schedule, plan.pp, m, pp_rank)
    found = {}
    for stage in stage_ids(schedule, pp_rank, plan.pp):
        kinds = frozenset(kind for kind, at in actions if at == stage)
        key = ("stage", stage, total, samples, plan.activation_checkpointing, kinds)
        if key not in replays:
            replays[key] = stage_passes(model.module, replays["inputs", total, samples][stage],
                                        stage, total, plan.activation_checkpointing, kinds)
        found[stage] = replays[key]
    return found


def step_time(model: Model, job: Job, options: Options, candidate: Candidate, acts,
              machine: Machine) -> StepTime:
    """Rank 0's step (every rank of a layout does the same share, but pipeline ends)."""
    plan = candidate.plan
    samples = job.data["batch_size"] / plan.dp
    unsharded = dataclasses.replace(plan, data_parallel=None)
    held = held_parameters(model.module, unsharded, 0)
    units = sum(len(m.blocks()) + 1 for m in stages(model.module, plan, 0))
    zero = candidate.strategy.shards_optimizer and isinstance(plan.data_parallel, DDPOptions)
    collectives = [
        *data_parallel_collectives(plan, sum(h.nbytes for h in held), units, model.element_ratio,
                                   options.network.bucket_cap_mb * MIB, zero, len(held)),
        *tp_collectives(model.tp_layers, plan, samples, int(4 * model.element_ratio)),
        *pipeline_collectives(plan, max(acts.block_inputs, default=0.0), samples),
    ]
    return StepTime(
        compute_seconds(model.flops_per_sample, samples, plan, machine.flops_per_s),
        comm_seconds(collectives, machine.links), bubble(plan),
        sum(c.wire_bytes for c in collectives if c.group > 1),
    )


def plan_job(job: Job, options: Options, machine: Machine, memory_limit: float | None
             ) -> list[Row]:
    """Every candidate's predictions, fastest that fits first (`rank_rows`)."""
    return rank_rows(predict(job, options, candidates(job, options), machine, memory_limit))


def predict(job: Job, options: Options, layouts: list[Candidate], machine: Machine,
            memory_limit: float | None) -> list[Row]:
    """The predictions for each of `layouts`, in their order."""
    model = meta_model(job, options)
    acts = saved_activations(model.module, model.input_shape, batch=2)
    rows, replays = [], {}
    for candidate in layouts:
        ranks = [rank_memory(model, job, options, candidate, r, acts, replays, machine)
                 for r in range(job.launch.world_size)]
        fits = memory_limit is None or max(m.device for m in ranks) <= memory_limit
        rows.append(Row(candidate, ranks,
                        step_time(model, job, options, candidate, acts, machine), fits))
    return rows


def rank_rows(rows: list[Row]) -> list[Row]:
    """Those that fit before those that do not, each by predicted step time."""
    return sorted(rows, key=lambda r: (not r.fits, r.time.seconds))


def smallest(rows: list[Row]) -> Row:
    """The layout that needs the least device memory per rank."""
    return min(rows, key=lambda r: r.memory.device)


def format_table(rows: list[Row]) -> str:
    """The ranked table: layout, predicted bytes per rank, predicted step time, fits."""
    header = f"{'#':>3}  {'layout':<72} {'state MiB':>9} {'device MiB':>10} {'step ms':>9} fits"
    lines = [header]
    for i, row in enumerate(rows, 1):
        lines.append(
            f"{i:>3}  {row.candidate.name:<72} {max(row.state_per_rank) / MIB:>9.3f} "
            f"{row.memory.device / MIB:>10.3f} {row.time.seconds * 1e3:>9.3f} "
            f"{'yes' if row.fits else 'no'}"
        )
    return "\n".join(lines)


