"""The layouts a planner weighs: every strategy override set the rules allow at the world size.

A candidate is what a user would write (`strategy=fsdp strategy.cpu_offload=true`), the strategy
option built from it and the `ParallelPlan` it states. The list is drawn from conf/strategy's
own options, so it holds only what the project can run, and is filtered by the same checks
`prepare` applies to a job: the cross-group rules of `mgpu.support` (a model without a
tensor-parallel plan drops tp and hybrid tp > 1) and the strategy's own `validate` (degrees that
do not divide the heads, micro-batches that do not divide the batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mgpu import support
from mgpu.errors import ConfigError
from mgpu.options import build, conf_nodes, option_name
from mgpu.parallel import ParallelPlan
from mgpu.pipeline import SCHEDULES

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

#: What each block recomputes in backward, as candidates weigh it ("selective" is left out:
#: its memory lies between the two and the planner has no estimate of its own for it).
RECOMPUTE = ("none", "full")
#: At most this many micro-batch counts per pipeline: pp, 2 pp, 4 pp (those that divide).
MICROBATCH_FACTORS = (1, 2, 4)
#: Strategies a planner never proposes: one process, and the planner's own option.
NOT_CANDIDATES = ("single", "auto")


@dataclass(frozen=True)
class Candidate:
    """One layout: its override set, the strategy built from it, and the plan it states."""

    #: The strategy node (conf/strategy/<option>.yaml updated by `settings`).
    node: dict[str, Any]
    #: The settings that differ from the option's YAML, as `strategy.<key>=<value>`.
    settings: dict[str, Any]
    option: str
    strategy: Any
    plan: ParallelPlan

    @property
    def name(self) -> str:
        """The override set a user would write: `strategy=pp strategy.microbatches=8`."""
        keys = " ".join(f"strategy.{k}={_yaml(v)}" for k, v in self.settings.items())
        return f"strategy={self.option}" + (f" {keys}" if keys else "")

    def overrides(self) -> list[str]:
        """The same as Hydra command-line overrides."""
        return self.name.split(" ")


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(pp: int, local_batch: int) -> list[int]:
    """pp, 2 pp and 4 pp micro-batches, those that divide the pipeline's batch."""
    counts = [pp * f for f in MICROBATCH_FACTORS]
    return [m for m in counts if m <= local_batch and local_batch % m == 0]


def pipeline_settings(pp: int, local_batch: int) -> Iterator[dict[str, Any]]:
    """Every synchronous schedule: a stale one (2bw) computes another update, which is the
    user's choice to make, not the planner's."""
    for schedule in (name for name, spec in SCHEDULES.items() if not spec.stale):
        for microbatches in microbatch_counts(pp, local_batch):
            yield {"schedule": schedule, "microbatches": microbatches}


def strategy_settings(world: int, batch: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(option, settings) of every layout of `world` ranks, before any rule is applied."""
    yield "ddp", {}
    yield "zero1", {}
    for reshard in (True, False):
        for offload in (False, True):
            yield "fsdp", {"reshard_after_forward": reshard, "cpu_offload": offload}
    yield "tp", {}
    for settings in pipeline_settings(world, batch):
        yield "pp", settings
    for dp in divisors(world):
        for tp in divisors(world // dp):
            pp = world // dp // tp
            if sum(d > 1 for d in (dp, tp, pp)) < 2:
                continue  # one dim alone is ddp/fsdp, tp or pp above
            degrees = {"dp": dp, "tp": tp, "pp": pp}
            if pp == 1:
                yield "hybrid", degrees
                continue
            for settings in pipeline_settings(pp, batch // dp):
                yield "hybrid", {**degrees, **settings}


def candidates(job: Job, options: Options) -> list[Candidate]:
    """Every layout of the job's world size that its other options, model and data allow,
    each without and with activation checkpointing."""
    world, batch = job.launch.world_size, job.data["batch_size"]
    nodes = conf_nodes("strategy")
    found = []
    for option, settings in strategy_settings(world, batch):
        for recompute in RECOMPUTE:
            extra = {**settings, "activation_checkpointing": recompute}
            if recompute == "none":
                extra.pop("activation_checkpointing")
            node = {**nodes[option], **extra}
            candidate = allowed(job, options, option, node, extra)
            if candidate is not None:
                found.append(candidate)
    return found


def allowed(
    job: Job, options: Options, option: str, node: dict[str, Any], settings: dict[str, Any]
) -> Candidate | None:
    """The candidate, or None where the rules or the strategy's own checks refuse it."""
    try:
        strategy = build(node)
        chosen = {**support.job_options(job, options),
                  "strategy": support.Option("strategy", f"strategy={option}", strategy)}
        if support.refusal(chosen):
            return None
        strategy.validate(dataclasses.replace(job, strategy=node), options)
    except ConfigError:
        return None
    return Candidate(node, settings, option, strategy, strategy.plan(job.launch.world_size))


def own_candidate(job: Job, options: Options) -> Candidate:
    """The job's own strategy as a candidate (a run that named its layout), its settings those
    that differ from its option's YAML."""
    node = job.strategy
    option = option_name("strategy", node["_target_"]).removeprefix("strategy=")
    yaml = conf_nodes("strategy").get(option, {})
    settings = {k: v for k, v in node.items() if k != "_target_" and yaml.get(k) != v}
    strategy = options.strategy
    return Candidate(node, settings, option, strategy, strategy.plan(job.launch.world_size))
