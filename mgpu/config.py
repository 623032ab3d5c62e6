"""Validation: everything that can be wrong with a config fails here, in the parent.

`prepare` resolves the composed config once into the `Job` every worker gets (pickled; its
schema is `mgpu.job`), builds the options (`Options`: once per process, here and in each
worker), then runs the cross-group rules (`mgpu.support`, from what each option declares) and
each option's own checks on them. Group nodes are checked against the constructor of their
`_target_` (`check_group`). A misspelt field is an AttributeError where it is read, in the
parent, before anything starts.

This module sits above the parts it checks (support rules, checkpoint, model, strategy):
they import the schema from `mgpu.job`, never this module.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import mgpu.cluster  # noqa: F401  (registers ${mgpu.allocation_endpoint:...}, experiment=slurm)
import mgpu.rundir  # noqa: F401  (registers ${mgpu.now:...} for hydra.run.dir)
from mgpu import support
from mgpu.checkpoint import check_checkpoint, check_resume_shapes, resumes_switched
from mgpu.elastic import parse_nnodes
from mgpu.errors import ConfigError
from mgpu.job import (
    DIRECTIONS,
    FAULT_MODES,
    GROUPS,
    SCHEDULE_KINDS,
    Job,
    SwitchConf,
    hydra_schema,
    resolve_tracking_uri,
    typed,
)
from mgpu.options import Options, build, conf_nodes, import_target, option_name

log = logging.getLogger(__name__)


def _signature_schema(target: Any, skip: set[str]) -> type:
    """A dataclass mirroring the constructor's keyword arguments, for OmegaConf to type-check."""
    hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    fields = []
    for name, p in inspect.signature(target).parameters.items():
        if name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = MISSING if p.default is p.empty else p.default
        if isinstance(default, (list, dict, tuple)):  # mutable defaults need a factory
            default = field(default_factory=lambda d=default: copy.deepcopy(_listify(d)))
        fields.append((name, hints.get(name, Any), default))
    return dataclasses.make_dataclass(f"{target.__name__}Schema", fields)


def _listify(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def check_group(group: str, node: dict, runtime_args: tuple[str, ...] = ()) -> dict:
    """Check a group node against its `_target_`'s constructor; return it with types converted.

    `runtime_args` are constructor arguments the worker supplies (e.g. a model's input shape),
    which the YAML must not set.
    """
    target_path = node.get("_target_")
    if not target_path:
        raise ConfigError(f"{group}: no _target_; each option names the class that implements it")
    target = import_target(target_path)
    params = inspect.signature(target).parameters
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = [k for k, p in params.items() if k not in runtime_args and p.kind in kinds]
    for key in node:
        if key != "_target_" and key not in valid:
            raise ConfigError(
                f"{group}.{key}: unknown key for {group} option {target.__name__}; "
                f"valid keys: {', '.join(valid) or '(none)'}"
            )
    schema = OmegaConf.structured(_signature_schema(target, set(runtime_args)))
    values = {k: v for k, v in node.items() if k != "_target_"}
    try:
        checked = OmegaConf.merge(schema, values)
    except OmegaConfBaseException as e:
        key = f"{group}.{getattr(e, 'full_key', '') or ''}".rstrip(".")
        raise ConfigError(f"{key}={getattr(e, 'value', '?')}: {e.msg.splitlines()[0]}") from None
    return {"_target_": target_path, **OmegaConf.to_container(checked)}


def _positive(key: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{key}={value}: must be >= {minimum}")


def resolve_nproc(value: str, fixed: int | None, cuda_devices: int) -> int:
    """`launch.nproc_per_node` as a number: auto = the strategy's fixed size, else GPUs, else 2."""
    if str(value) == "auto":
        return fixed or cuda_devices or 2
    try:
        nproc = int(value)
    except ValueError:
        raise ConfigError(
            f"launch.nproc_per_node={value}: use a positive integer or auto"
        ) from None
    _positive("launch.nproc_per_node", nproc)
    return nproc


def check_gpus(requested: Any, nproc: int, cuda_devices: int, strategy: str) -> None:
    """Each process of a node takes a GPU of its own (`runtime.pick_device`): a host with
    GPUs cannot run more processes than it has, where the last would fail in set_device."""
    if not cuda_devices or nproc <= cuda_devices:
        return
    fits = f"launch.nproc_per_node={cuda_devices}"
    if str(requested) != "auto":
        why, fix = "", f"use {fits} or auto"
    else:  # the strategy's fixed layout: smaller, or the same over several hosts
        why = f"{strategy} lays one model over {nproc} ranks, so "
        fix = f"lay the model over at most {cuda_devices} ranks"
        if nproc % cuda_devices == 0:
            fix += f", or over {nproc // cuda_devices} hosts ({fits} launch.nnodes=" \
                   f"{nproc // cuda_devices})"
    raise ConfigError(
        f"launch.nproc_per_node={requested}: {why}each node starts {nproc} processes, one per "
        f"GPU: needs {nproc} GPUs, found {cuda_devices}; {fix}"
    )


def check_root_schema(values: dict) -> None:
    """The root sections against the schema: catches keys added with `+` that Hydra let in."""
    root = {key: value for key, value in values.items() if key not in GROUPS}
    try:
        OmegaConf.merge(OmegaConf.structured(hydra_schema(Job)), root)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.full_key}: {e.msg.strip().splitlines()[0]}") from None


def check_root(values: dict) -> None:
    """Rules on the root sections alone."""
    train, launch, fault = values["train"], values["launch"], values["fault"]
    _positive("train.steps", train["steps"])
    _positive("train.grad_accum", train["grad_accum"])
    _positive("train.log_every", train["log_every"])
    _positive("train.warmup_steps", train["warmup_steps"], 0)
    cap_warmup(train)
    _positive("eval.every_steps", values["eval"]["every_steps"], 0)
    _positive("eval.batch_size", values["eval"]["batch_size"])
    _positive("launch.max_restarts", launch["max_restarts"], 0)
    _positive("launch.timeout_s", launch["timeout_s"])
    _positive("launch.rdzv_timeout_s", launch["rdzv_timeout_s"])
    _positive("launch.rdzv_last_call_s", launch["rdzv_last_call_s"], 0)
    _positive("launch.rdzv_heartbeat_s", launch["rdzv_heartbeat_s"])
    if fault["mode"] is not None and fault["mode"] not in FAULT_MODES:
        raise ConfigError(f"fault.mode={fault['mode']}: use null, {' or '.join(FAULT_MODES)}")
    direction = values["tracking"]["objective"]["direction"]
    if direction not in DIRECTIONS:
        raise ConfigError(
            f"tracking.objective.direction={direction}: use {' or '.join(DIRECTIONS)}")


def cap_warmup(train: dict) -> None:
    """At most half of a run is warm-up: a short run (`train.steps=10`) still times steps.

    The capped value is the one workers and the run's params get, said in one log line.
    """
    cap = train["steps"] // 2
    if train["warmup_steps"] > cap:
        log.info(
            "train.warmup_steps=%d is more than half of train.steps=%d: warm-up capped at %d "
            "steps, so the rest are timed", train["warmup_steps"], train["steps"], cap,
        )
        train["warmup_steps"] = cap


def check_monitor(job: Job) -> None:
    monitor, steps = job.monitor, job.train.steps
    if monitor.interval_s <= 0:
        raise ConfigError(f"monitor.interval_s={monitor.interval_s}: must be > 0")
    port = monitor.prometheus_port
    if port is not None and not 1024 <= port <= 65535:
        raise ConfigError(
            f"monitor.prometheus_port={port}: use a port in 1024..65535 (local rank 0 serves "
            f"every rank of its node there), or null for no exporter"
        )
    if monitor.profile:
        start, count = monitor.profile_start_step, monitor.profile_steps
        _positive("monitor.profile_start_step", start, 2)
        _positive("monitor.profile_steps", count)
        if start + count - 1 > steps:
            raise ConfigError(
                f"monitor.profile_start_step={start} + profile_steps={count} runs past "
                f"train.steps={steps}; profile an earlier window"
            )


def check_batch(job: Job, world_sizes: list[int]) -> None:
    """The global batch must split into equal micro-batches over ranks and accumulation steps
    at every world size the job may run at: an elastic `launch.nnodes=MIN:MAX` allows one per
    node count, and at any of them an uneven split would leave samples out while the loss
    is still divided by the whole batch."""
    batch, accum = job.data["batch_size"], job.train.grad_accum
    _positive("data.batch_size", batch)
    for world_size in world_sizes:
        if batch % (world_size * accum) == 0:
            continue
        message = (f"data.batch_size={batch}: must be divisible by world size ({world_size}) x "
                   f"train.grad_accum ({accum}) = {world_size * accum}")
        if len(world_sizes) > 1:
            uneven = support.alternatives("balance", lambda b: b.declares("uneven"))
            message += (
                f", and launch.nnodes={job.launch.nnodes} lets the job run on "
                f"{', '.join(map(str, world_sizes))} ranks; use a data.batch_size divisible by "
                f"{math.lcm(*world_sizes) * accum}, a narrower launch.nnodes, or {uneven}")
        raise ConfigError(message)


def check_fault(job: Job) -> None:
    world_size = job.launch.world_size
    if job.fault.mode and not 0 <= job.fault.kill_rank < world_size:
        raise ConfigError(
            f"fault.kill_rank={job.fault.kill_rank}: must be a rank in 0..{world_size - 1}"
        )
    check_fault_schedule(job)


def check_fault_schedule(job: Job) -> None:
    """`fault.schedule`: each fault costs one restart of the worker group, at a step of its
    own; a hang needs a peer whose collective times out, a checkpoint kill a checkpoint."""
    schedule, count = job.fault.schedule, job.fault.schedule.count
    _positive("fault.schedule.count", count, 0)
    if count == 0:
        return
    if job.fault.mode:
        raise ConfigError(f"fault.schedule.count={count} with fault.mode={job.fault.mode}: "
                          "use one of them (fault.mode=null with a schedule)")
    unknown = [kind for kind in schedule.kinds if kind not in SCHEDULE_KINDS]
    if unknown or not schedule.kinds:
        raise ConfigError(f"fault.schedule.kinds={list(schedule.kinds)}: use a list of "
                          f"{', '.join(SCHEDULE_KINDS)}")
    if count > job.launch.max_restarts:
        raise ConfigError(f"fault.schedule.count={count}: each fault restarts the worker group "
                          f"once; set launch.max_restarts >= {count} (it is "
                          f"{job.launch.max_restarts})")
    kinds = [schedule.kinds[i % len(schedule.kinds)] for i in range(count)]
    if "hang" in kinds and job.launch.world_size < 2:
        raise ConfigError("fault.schedule.kinds: a hang is caught by a peer's collective "
                          "timeout, and one rank has none; drop hang or run >= 2 ranks")
    if count > job.train.steps:
        raise ConfigError(f"fault.schedule.count={count}: more faults than train.steps="
                          f"{job.train.steps}, one step each; use fewer")
    every = job.checkpoint.every_steps
    saves = job.train.steps // every if every > 0 else 0
    if kinds.count("checkpoint_sigkill") > saves:
        raise ConfigError(
            f"fault.schedule.kinds: {kinds.count('checkpoint_sigkill')} checkpoint_sigkill "
            f"faults need as many checkpoints, the run saves {saves} (checkpoint.every_steps="
            f"{every}); save more often or drop checkpoint_sigkill")
    if job.switch.to is not None:
        raise ConfigError(f"fault.schedule.count={count} with switch.to: the switch relaunches "
                          "the worker group, whose restart count (which picks the fault to "
                          "fire) starts again at 0; use one of them")


def check_straggler(job: Job) -> None:
    slowdown, jitter = job.straggler.slowdown, job.straggler.jitter_s
    if slowdown and len(slowdown) != job.launch.world_size:
        raise ConfigError(
            f"straggler.slowdown={slowdown}: give one factor per rank ({job.launch.world_size}), "
            "or []"
        )
    if any(factor < 1 for factor in slowdown):
        raise ConfigError(f"straggler.slowdown={slowdown}: factors must be >= 1.0 (1.0 = no delay)")
    if jitter < 0:
        raise ConfigError(f"straggler.jitter_s={jitter}: must be >= 0")


def prepare(
    cfg: DictConfig, cuda_devices: int, torchrun_world: tuple[int, int] | None
) -> tuple[Job, Options]:
    """Validate the composed config and resolve it once into the `Job` workers receive, with
    the options this process built to check it.

    `torchrun_world` is (world size, local world size) when torchrun started this process.
    """
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{getattr(e, 'full_key', '')}: {e.msg.splitlines()[0]}") from None
    values.pop("hydra", None)
    for group in GROUPS:
        runtime_args = ("input_shape", "num_classes") if group == "model" else ()
        values[group] = check_group(group, values[group], runtime_args)
    check_root_schema(values)
    check_root(values)

    options = Options.of(values)
    fixed = getattr(options.strategy, "world_size", None)
    if torchrun_world:
        world_size, nproc = torchrun_world
        world_sizes = [world_size]
    else:
        min_nodes, max_nodes = parse_nnodes(values["launch"]["nnodes"])
        nproc = resolve_nproc(values["launch"]["nproc_per_node"], fixed, cuda_devices)
        # An elastic job starts at its smallest size and may run at any up to the largest.
        world_sizes = [nodes * nproc for nodes in range(min_nodes, max_nodes + 1)]
        world_size = world_sizes[0]
    check_gpus(values["launch"]["nproc_per_node"], nproc, cuda_devices,
               option_name("strategy", values["strategy"]["_target_"]))
    values["launch"].update(nproc_per_node=nproc, world_size=world_size)
    values["output_dir"] = str(Path(values["output_dir"]).resolve())
    values["tracking"]["uri"] = resolve_tracking_uri(values["tracking"]["uri"])
    job = typed(Job, values)
    if getattr(options.strategy, "planned", False):  # strategy=auto: a layout of its choice
        job, options = options.strategy.resolve(job, options, cuda_devices, bool(torchrun_world))

    support.check(job, options)  # options of different groups that cannot run together
    model = check_model(options)
    if not options.balance.uneven:  # uneven splits check their own batch
        check_batch(job, world_sizes)
    check_fault(job)
    check_monitor(job)
    check_straggler(job)
    for group in GROUPS:
        option = None if group == "model" else getattr(options, group)
        if hasattr(option, "validate"):
            option.validate(job, options)
    job = check_checkpoint(check_switch(job, torchrun_world is not None))
    check_resume_shapes(job, model)
    if job.switch.to is not None and resumes_switched(job.checkpoint, job.resume):
        job = switched_before(job)
        options = Options.of(job.groups())
    return job, options


def switched_before(job: Job) -> Job:
    """The job whose checkpoint to resume was saved at or after its switch: a re-run of a run
    that switched goes on where it stopped, with the strategy it switched to (its triggers
    fired already: a run switches once)."""
    log.info("resume: the checkpoint was saved after the run switched strategy; it goes on "
             "with switch.to")
    return dataclasses.replace(job, strategy=job.switch.to,
                               switch=SwitchConf(when=job.switch.when, switched=True))


def check_switch(job: Job, under_torchrun: bool) -> Job:
    """`switch`, checked as the run after the switch would be (the support rules and the new
    strategy's own checks); returns the job with `switch.to` as the whole strategy node."""
    to = job.switch.to
    triggers = switch_triggers(job)
    if to is None:
        if triggers:
            raise ConfigError(f"{triggers[0]}: no switch.to to switch to; name a strategy, "
                              "e.g. switch.to={name:fsdp}")
        return job
    if not isinstance(to, dict):
        to = {"name": to}
    given = ",".join(f"{key}:{value}" for key, value in to.items())
    if under_torchrun:
        raise ConfigError(f"switch.to={{{given}}}: torchrun cannot relaunch its workers with "
                          "another strategy; run python -m mgpu, or resume the checkpoint "
                          "with the new strategy yourself")
    if not triggers:
        raise ConfigError(f"switch.to={{{given}}}: no trigger set; set switch.when.at_step, "
                          "switch.when.loss_plateau.window, switch.when.throughput_drop.window "
                          "or switch.when.oom=true")
    node = strategy_node(to)
    after = dataclasses.replace(job, strategy=node, switch=SwitchConf())
    options = Options.of(after.groups())
    try:
        support.check(after, options)
        options.strategy.validate(after, options)
    except ConfigError as e:
        raise ConfigError(f"switch.to={{{given}}} is refused: {e}") from None
    return dataclasses.replace(job, switch=dataclasses.replace(job.switch, to=node))


def switch_triggers(job: Job) -> list[str]:
    """The `switch.when` triggers the job sets (as `key=value`), each checked: it can fire
    before the run ends, and every rank reads the same figures to decide it."""
    when, steps, log_every = job.switch.when, job.train.steps, job.train.log_every
    if when.at_step and not 0 < when.at_step < steps:
        raise ConfigError(f"switch.when.at_step={when.at_step}: must be between 1 and "
                          f"train.steps - 1 = {steps - 1}, or 0 (off)")
    windows = {"loss_plateau": when.loss_plateau.window,
               "throughput_drop": when.throughput_drop.window}
    for trigger, window in windows.items():
        key = f"switch.when.{trigger}.window={window}"
        if window < 0 or window % log_every:
            raise ConfigError(f"{key}: must be a multiple of train.log_every={log_every} (the "
                              "trigger reads the figures of log points), or 0 (off)")
        if 2 * window >= steps:
            raise ConfigError(f"{key}: two windows must fit before train.steps={steps}; use a "
                              f"window below {(steps + 1) // 2} steps")
    threshold = when.loss_plateau.threshold
    if not 0 <= threshold < 1:
        raise ConfigError(f"switch.when.loss_plateau.threshold={threshold}: a relative "
                          "improvement per window in [0, 1), e.g. 0.01 (switch once the loss "
                          "falls by less than 1% from one window to the next)")
    fraction = when.throughput_drop.fraction
    if not 0 < fraction < 1:
        raise ConfigError(f"switch.when.throughput_drop.fraction={fraction}: a share of the "
                          "best window's samples/s in (0, 1), e.g. 0.8 (switch below 80% of it)")
    if when.oom and job.checkpoint.every_steps == 0:
        raise ConfigError("switch.when.oom=true: an out-of-memory switch resumes the last "
                          "checkpoint; set checkpoint.every_steps > 0")
    if when.oom and parse_nnodes(job.launch.nnodes)[1] > 1:
        raise ConfigError(f"switch.when.oom=true: launch.nnodes={job.launch.nnodes} may span "
                          "nodes, whose launchers each see only their own ranks' errors; run "
                          "on one node, or switch at_step or on loss_plateau")
    chosen = {"switch.when.at_step": when.at_step,
              "switch.when.loss_plateau.window": windows["loss_plateau"],
              "switch.when.throughput_drop.window": windows["throughput_drop"],
              "switch.when.oom": when.oom}
    return [f"{key}={str(value).lower()}" for key, value in chosen.items() if value]


def strategy_node(to: dict[str, Any]) -> dict[str, Any]:
    """`switch.to` ({name: <option of conf/strategy>, its keys...}) as a checked strategy node."""
    given = ",".join(f"{key}:{value}" for key, value in to.items())
    options = conf_nodes("strategy")
    # A planner (strategy=auto) picks its layout in the parent, before any launch.
    layouts = {n: node for n, node in options.items() if not getattr(build(node), "planned", 0)}
    name = to.get("name")
    if name in options and name not in layouts:
        raise ConfigError(f"switch.to={{{given}}}: strategy={name} picks a layout before "
                          "launch, not mid-run; name the layout to switch to, e.g. {name:fsdp}")
    if name not in layouts:
        raise ConfigError(f"switch.to={{{given}}}: name must be a strategy option: "
                          f"{', '.join(layouts)}")
    node = layouts[name]
    node.update({key: value for key, value in to.items() if key != "name"})
    try:
        return check_group("strategy", node)
    except ConfigError as e:
        raise ConfigError(f"switch.to={{{given}}}: {e}") from None


def check_model(options: Options) -> torch.nn.Module:
    """The model's own checks (sizes that do not fit each other or the data) in the parent,
    by building it on the meta device, where no memory is allocated and no weight computed.
    Returns it as the run stores it (its precision's padding), for the checkpoint check."""
    data = options.data
    with torch.device("meta"):
        model = options.model(input_shape=data.input_shape, num_classes=data.num_classes)
        return options.precision.prepare(model)
