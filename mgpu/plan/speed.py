"""Step time of a layout: compute from the model's FLOPs over a measured rate, communication
from the collectives the layout issues over a bandwidth/latency table, and the pipeline bubble.

Bytes on the wire follow `comm/bytes_per_step`'s ring accounting (`mgpu.compression.commhook`):
all-reduce of S over g ranks sends 2(g-1)/g S per rank, all-gather of a shard P sends (g-1) P,
reduce-scatter of S sends (g-1)/g S. That is also how `task=commbench` turns a time into bus
bandwidth, so a collective takes latency + wire bytes / bus bandwidth, with the latency and peak
bus bandwidth commbench measured for that op. Communication is counted as not overlapping
compute: on the CPU stand-in gloo shares the cores with compute, and on GPUs it keeps the
prediction an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mgpu.compression.commhook import (
    all_gather_wire_bytes,
    all_reduce_wire_bytes,
    all_to_all_wire_bytes,
)
from mgpu.parallel import DDPOptions, FSDPOptions, ParallelPlan
from mgpu.pipeline import stages_per_rank


@dataclass(frozen=True)
class Link:
    """One collective's cost on this machine: a fixed latency per call, then bus bandwidth."""

    latency_s: float
    busbw_Bps: float

    def seconds(self, wire_bytes: float, calls: int) -> float:
        return calls * self.latency_s + wire_bytes / self.busbw_Bps


@dataclass(frozen=True)
class Collective:
    """`calls` calls of `op` over `group` ranks that send `wire_bytes` per rank in all."""

    op: str
    group: int
    wire_bytes: float
    calls: int


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    bubble: float
    comm_bytes: float

    @property
    def seconds(self) -> float:
        """Compute stretched by the pipeline's idle share, then communication on top."""
        return self.compute_s / (1 - self.bubble) + self.comm_s


def bubble(plan: ParallelPlan) -> float:
    """The schedule's idle share: (p - 1) / (v m + p - 1), as `Pipeline.theory_bubble`."""
    if plan.pipeline is None:
        return 0.0
    per_rank = stages_per_rank(plan.pipeline.schedule)
    return (plan.pp - 1) / (per_rank * plan.pipeline.microbatches + plan.pp - 1)


def tp_layers(model: nn.Module, input_shape: tuple, sequence_parallel: bool = False
              ) -> list[tuple[Any, int, int]]:
    """(style, input elements, output elements) per sample of every layer the model's
    tensor-parallel plan splits, from one forward of the meta model."""
    if not callable(getattr(model, "tp_plan", None)):
        return []
    found: list[tuple[Any, int, int]] = []
    handles = []
    for block in model.blocks():
        for path, style in model.tp_plan(sequence_parallel).items():
            if not isinstance(style, ColwiseParallel | RowwiseParallel):
                continue

            def record(module, args, output, style=style):
                found.append((style, args[0].numel(), output.numel()))

            handles.append(block.get_submodule(path).register_forward_hook(record))
    try:
        dtype = torch.long if len(input_shape) == 1 else torch.float32
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, dtype=dtype, device="meta"))
    finally:
        for handle in handles:
            handle.remove()
    return found


def tp_collectives(layers: list[tuple[Any, int, int]], plan: ParallelPlan, samples: float,
                   element_size: int) -> list[Collective]:
    """A column-wise layer all-reduces its input's gradient in backward (and all-gathers its
    output in forward where it hands on a replicated output); a row-wise layer all-reduces its
    output in forward."""
    if plan.tp == 1:
        return []
    stage_share = 1 / plan.pp
    out = []
    for style, inputs, outputs in layers:
        if isinstance(style, ColwiseParallel):
            out.append(Collective("all_reduce", plan.tp, all_reduce_wire_bytes(
                inputs * samples * element_size, plan.tp) * stage_share, 1))
            if isinstance(style.output_layouts[0], Replicate):
                out.append(Collective("all_gather", plan.tp, all_gather_wire_bytes(
                    outputs * samples * element_size / plan.tp, plan.tp) * stage_share, 1))
        else:
            out.append(Collective("all_reduce", plan.tp, all_reduce_wire_bytes(
                outputs * samples * element_size, plan.tp) * stage_share, 1))
    return out


def data_parallel_collectives(
    plan: ParallelPlan, unsharded_bytes: float, units: int, compute_ratio: float,
    bucket_bytes: float, zero: bool, param_tensors: int,
) -> list[Collective]:
    """Gradients over the data-parallel ranks: DDP all-reduces them in buckets (ZeRO-1 then
    broadcasts every rank's updated partition); FSDP2 all-gathers each unit's parameters in the
    compute dtype before forward (and again before backward when it reshards after forward, per
    micro-batch under a pipeline), reduce-scatters its gradients, and all-reduces the shards over
    the replicate dim (HSDP). `unsharded_bytes`: this rank's stage parameters after tensor
    parallelism, before data-parallel sharding (fp32)."""
    data_parallel = plan.data_parallel
    out = []
    if isinstance(data_parallel, DDPOptions) and plan.dp_replicate > 1:
        buckets = max(1, -(-int(unsharded_bytes) // int(bucket_bytes)))
        out.append(Collective("all_reduce", plan.dp_replicate,
                              all_reduce_wire_bytes(unsharded_bytes, plan.dp_replicate), buckets))
        if zero:
            out.append(Collective("broadcast", plan.dp_replicate, unsharded_bytes, param_tensors))
    if isinstance(data_parallel, FSDPOptions):
        n = plan.dp_shard
        if n > 1:
            micro = plan.pipeline.microbatches if plan.pipeline is not None else 1
            gathers = micro * (2 if data_parallel.reshard_after_forward else 1)
            gathered = all_gather_wire_bytes(unsharded_bytes * compute_ratio / n, n)
            out.append(Collective("all_gather", n, gathered * gathers, units * gathers))
            out.append(Collective("reduce_scatter", n,
                                  all_to_all_wire_bytes(unsharded_bytes, n), units))
        if plan.dp_replicate > 1:
            out.append(Collective("all_reduce", plan.dp_replicate, all_reduce_wire_bytes(
                unsharded_bytes / n, plan.dp_replicate), units))
    return out


def pipeline_collectives(plan: ParallelPlan, boundary_bytes: float, samples: float
                         ) -> list[Collective]:
    """Each micro-batch's activations sent to the next stage and their gradient sent back:
    `boundary_bytes` per sample, point to point (timed as a two-rank broadcast)."""
    if plan.pipeline is None:
        return []
    per_rank = stages_per_rank(plan.pipeline.schedule)
    micro = plan.pipeline.microbatches * per_rank
    return [Collective("broadcast", 2, 2 * boundary_bytes * samples * per_rank, 2 * micro)]


def comm_seconds(collectives: list[Collective], links: dict[str, Link]) -> float:
    return sum(links[c.op].seconds(c.wire_bytes, c.calls) for c in collectives if c.group > 1)


def compute_seconds(flops_per_sample: float, samples: float, plan: ParallelPlan,
                    flops_per_s: float) -> float:
    """This rank's share of the step's FLOPs (its tp slice of its pp stages of its samples);
    full recompute runs each block's forward twice (4/3 of forward + backward)."""
    recompute = 4 / 3 if plan.activation_checkpointing != "none" else 1.0
    return flops_per_sample * samples * recompute / (plan.tp * plan.pp) / flops_per_s
