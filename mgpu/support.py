"""Which options of different groups run together: rules over what each option declares.

Every option states what it offers and needs as plain class attributes: a strategy whether it
takes a DDP comm hook, runs a pipeline, lets ranks take unequal batches; a precision whether it
scales the loss; a compression whether it is a comm hook; a balance whether it splits the batch
unevenly; a model which parallel plans it has, whether it keeps batch statistics and whether it
predicts the next token; a data set whether its samples are token sequences. The rules
below read only those declarations, never class names, so an option added later (a user's own
class too) joins them by declaring what it does.

Each rule concerns two groups. The same rules refuse a bad job in the parent (`check`) and
draw the pairwise support matrix (`mgpu/matrix.py`), so the two cannot disagree.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mgpu.errors import ConfigError
from mgpu.options import build, conf_nodes, import_target, option_name

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

#: The groups (and the one root key) whose combinations the rules and the matrix cover.
AXES = ("strategy", "precision", "compression", "balance", "model", "data", "grad_accum")
GRAD_ACCUM_KEY = "train.grad_accum"

#: Model methods a strategy may need, and what they give it.
MODEL_PLANS = {
    "tp_plan": "a tensor-parallel plan (tp_plan)",
    "pipeline_stage": "pipeline split points (pipeline_stage)",
}
#: Why a model may lack a plan: the torch fact behind the refusal.
PLAN_LIMITS = {
    "tp_plan": "torch's tensor-parallel styles cover Linear and Embedding layers only",
}


@dataclass(frozen=True)
class Option:
    """One choice on one axis: how the user writes it, and the object that declares what it
    does (a settings instance; for a model its class; for grad_accum the number)."""

    axis: str
    name: str  # "strategy=ddp", "train.grad_accum=2"
    obj: Any
    #: Settings the option is tried with beyond its YAML ((key, value) pairs), e.g. a hybrid
    #: strategy's degrees: written after its name on the command line.
    layout: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        return self.name

    def declares(self, attribute: str) -> Any:
        """The option's declaration `attribute`; a ConfigError names it if the class has none."""
        try:
            return getattr(self.obj, attribute)
        except AttributeError:
            raise ConfigError(
                f"{self.name}: {type(self.obj).__name__} declares no `{attribute}`; every "
                f"{self.axis} option states it (see mgpu/{self.axis}/__init__.py)"
            ) from None


# ---- the options as configured in conf/ ------------------------------------------------------


def conf_options(group: str, settings: dict[str, tuple[dict, ...]] | None = None) -> list[Option]:
    """Every option of `group` in conf/, built from its YAML: settings objects for the groups
    that have them, the class itself for a model. An option named in `settings` is built once
    per layout listed there (its YAML updated by it), in that order. An option that only plans
    another (strategy=auto) is not one: it resolves before the rules apply."""
    options = []
    for name, node in conf_nodes(group).items():
        for layout in (settings or {}).get(name, ({},)):
            made = (import_target(node["_target_"]) if group == "model"
                    else build({**node, **layout}))
            if getattr(made, "planned", False):
                break  # strategy=auto: replaced by a concrete option before any rule reads it
            options.append(Option(group, f"{group}={name}", made, tuple(layout.items())))
    return options


def grad_accum_options(values: Iterable[int]) -> list[Option]:
    return [Option("grad_accum", f"{GRAD_ACCUM_KEY}={n}", n) for n in values]


def alternatives(group: str, accepted: Callable[[Option], bool]) -> str:
    """The options of `group` that `accepted` admits, as a user would write them."""
    names = [str(o) for o in catalogue(group) if accepted(o)]
    return " or ".join(names) or f"a {group} option that declares it"


@functools.cache
def catalogue(group: str) -> tuple[Option, ...]:
    """`group`'s options at their YAML settings (built once: conf/ does not change in a run)."""
    return tuple(conf_options(group))


# ---- the rules -------------------------------------------------------------------------------


def one_process(strategy: Option) -> bool:
    return strategy.declares("world_size") == 1


def no_hook_reason(strategy: Option) -> str:
    """The torch fact that leaves `strategy` without a DDP comm hook."""
    if one_process(strategy):
        return "one process has no gradients to exchange"
    if strategy.declares("sets_reduce_dtype"):
        return "FSDP2 has no comm hook for its reduce-scatter, only a dtype to reduce in"
    return ("its ranks hold parts of one model replica, so no gradient all-reduce runs for a "
            "hook to carry")


def compression_needs_a_comm_hook(compression: Option, strategy: Option) -> str | None:
    """A compression that is a DDP comm hook needs a strategy whose model takes one: one
    process exchanges no gradients, tp/pp ranks hold parts of one replica with no gradient
    all-reduce for a hook to carry, and FSDP2 has no reduce-scatter comm hook, so
    PowerSGD/onebit cannot reach its gradients; one that is only a wire dtype also runs where
    FSDP2 reduces gradients in that dtype."""
    if not compression.declares("needs_comm_hook") or strategy.declares("supports_comm_hook"):
        return None
    if compression.declares("wire_dtype") and strategy.declares("sets_reduce_dtype"):
        return None
    why = no_hook_reason(strategy)
    plain = alternatives("compression", lambda c: not c.declares("needs_comm_hook"))
    if strategy.declares("sets_reduce_dtype"):
        plain = alternatives("compression", lambda c: not c.declares("needs_comm_hook")
                             or bool(c.declares("wire_dtype")))
    return (f"{compression} cannot run with {strategy} ({why}); use "
            f"{alternatives('strategy', lambda s: s.declares('supports_comm_hook'))}, or {plain}")


def balance_needs_a_comm_hook(balance: Option, strategy: Option) -> str | None:
    """A balance that works through a DDP comm hook (stale gradients) needs a DDP model: one
    process has nothing to exchange, FSDP2 has no hook for its reduce-scatter, and tp/pp ranks
    hold parts of one replica, with no gradient all-reduce."""
    if not balance.declares("needs_comm_hook") or strategy.declares("supports_comm_hook"):
        return None
    why = f"it works through a DDP comm hook, and {no_hook_reason(strategy)}"
    return (f"{balance} cannot run with {strategy} ({why}); use "
            f"{alternatives('strategy', lambda s: s.declares('supports_comm_hook'))}, or "
            f"balance=none")


def one_comm_hook(balance: Option, compression: Option) -> str | None:
    """DDP takes one comm hook (register_comm_hook): where a balance and a compression both
    need theirs, the balance's must carry the compression (send in its wire dtype, or run its
    hook, as torch's fp16/bf16_compress_wrapper wraps a hook), and a balance that keeps
    exchanges in flight across steps (ssp) needs a compression whose exchanges may overlap
    (state a hook updates while its collectives run, as torch's powerSGD_hook does, needs one
    copy per exchange in flight)."""
    if not (balance.declares("needs_comm_hook") and compression.declares("needs_comm_hook")):
        return None
    carries = balance.declares("carries_compression")
    if carries and compression.declares("overlaps_steps"):
        return None
    plain = alternatives("compression", lambda c: not c.declares("needs_comm_hook")
                         or bool(carries and c.declares("overlaps_steps")))
    why = (f"DDP takes one comm hook, and each installs its own: {compression} compresses in "
           f"its hook, which {balance}'s cannot carry")
    if carries:
        why = (f"DDP takes one comm hook, and {balance}'s keeps each step's exchange in flight "
               f"while the next ones run, but {compression}'s exchanges cannot overlap: it "
               f"updates its state of a bucket while that bucket's collectives run, with one "
               f"copy of it, so overlapping steps would overwrite each other's")
    return (f"{balance} cannot run with {compression} ({why}); use {plain} with {balance}, or "
            f"balance=none")


def uneven_batches_need_local_steps(balance: Option, strategy: Option) -> str | None:
    """An uneven split is decided from each rank's own step time: its forward and backward less
    its time in FSDP2's collectives, the only ones inside them whose calls can be timed (tensor-
    and pipeline-parallel peers wait for each other inside every layer); tp/pp ranks read the
    same samples, with no split between them to move."""
    if not balance.declares("uneven") or strategy.declares("uneven_batches"):
        return None
    why = ("its ranks hold parts of one model replica and read the same samples, so there "
           "is no split of the batch between them to move")
    if strategy.declares("sets_reduce_dtype"):  # FSDP2 with tensor or pipeline parallelism
        why = ("its tensor- and pipeline-parallel peers wait for each other inside every layer, "
               "in DTensor's and the schedule's collectives, which no hook lets a clock take "
               "out of a rank's step time, so no rank's step time is its own work to split the "
               "batch by")
    return (f"{balance} cannot run with {strategy} ({why}); use "
            f"{alternatives('strategy', lambda s: s.declares('uneven_batches'))}, or balance=none")


def uneven_batches_change_batch_statistics(balance: Option, model: Option) -> str | None:
    """BatchNorm normalises over the local batch: unequal shares change what is computed, and
    torch.nn.SyncBatchNorm, which normalises over the global batch whatever the split, refuses
    CPU tensors (its batch_norm_stats kernel has no CPU implementation), where gloo runs."""
    if not balance.declares("uneven") or not model.declares("batch_statistics"):
        return None
    return (f"{balance} cannot run with {model} (the model normalises over each rank's local "
            f"batch, so unequal shares change what it computes, and torch.nn.SyncBatchNorm, "
            f"which would normalise over the global batch, refuses CPU tensors); use "
            f"balance=none, or "
            f"{alternatives('model', lambda m: not m.declares('batch_statistics'))}")


def strategy_needs_a_model_plan(strategy: Option, model: Option) -> str | None:
    """Tensor and pipeline parallelism split a model where the model says it can be split;
    torch's tensor-parallel styles cover Linear and Embedding layers only, so a model built on
    convolutions has no tensor-parallel plan."""
    for plan in strategy.declares("model_plans"):
        if not callable(getattr(model.obj, plan, None)):
            limit = f"; {PLAN_LIMITS[plan]}" if plan in PLAN_LIMITS else ""
            return (f"{strategy} cannot run with {model} (it needs a model with "
                    f"{MODEL_PLANS[plan]}, which {model.obj.__name__} lacks{limit}); use "
                    f"{alternatives('model', lambda m, p=plan: callable(getattr(m.obj, p, None)))}")
    return None


def token_data_needs_a_language_model(data: Option, model: Option) -> str | None:
    """Token sequences labelled with each next token need a model that predicts at every
    position; a classifier makes one prediction per sample."""
    if not data.declares("next_token") or model.declares("language_model"):
        return None
    return (f"{data} cannot run with {model} (its samples are token sequences whose every "
            f"position is labelled with the next token, which {model.obj.__name__} does not "
            f"predict); use {alternatives('model', lambda m: m.declares('language_model'))}")


@dataclass(frozen=True)
class Rule:
    axes: tuple[str, str]
    refusal: Callable[[Option, Option], str | None]

    @property
    def summary(self) -> str:
        """What the rule says, in general terms (its docstring, as one line)."""
        return " ".join(inspect.getdoc(self.refusal).split())


RULES = (
    Rule(("compression", "strategy"), compression_needs_a_comm_hook),
    Rule(("balance", "strategy"), balance_needs_a_comm_hook),
    Rule(("balance", "compression"), one_comm_hook),
    Rule(("balance", "strategy"), uneven_batches_need_local_steps),
    Rule(("balance", "model"), uneven_batches_change_batch_statistics),
    Rule(("strategy", "model"), strategy_needs_a_model_plan),
    Rule(("data", "model"), token_data_needs_a_language_model),
)


def pair_refusal(a: Option, b: Option) -> tuple[Rule, str] | None:
    """The rule that refuses options `a` and `b` (of two different axes) and its reason."""
    for rule in RULES:
        if rule.axes == (a.axis, b.axis):
            reason = rule.refusal(a, b)
        elif rule.axes == (b.axis, a.axis):
            reason = rule.refusal(b, a)
        else:
            continue
        if reason:
            return rule, reason
    return None


def refusal(chosen: dict[str, Option]) -> str | None:
    """The first reason the chosen options (one per axis) cannot run together, or None."""
    for rule in RULES:
        first, second = rule.axes
        if first in chosen and second in chosen:
            reason = rule.refusal(chosen[first], chosen[second])
            if reason:
                return reason
    return None


def job_options(job: Job, options: Options) -> dict[str, Option]:
    """The job's choice on every axis, as the rules read them."""
    chosen = {
        group: Option(group, option_name(group, getattr(job, group)["_target_"]),
                      getattr(options, group))
        for group in ("strategy", "precision", "compression", "balance", "data")
    }
    model = import_target(job.model["_target_"])
    chosen["model"] = Option("model", option_name("model", job.model["_target_"]), model)
    [chosen["grad_accum"]] = grad_accum_options([job.train.grad_accum])
    return chosen


def check(job: Job, options: Options) -> None:
    """ConfigError naming both keys where the job's options cannot run together (parent)."""
    reason = refusal(job_options(job, options))
    if reason:
        raise ConfigError(reason)

