"""The job's schema: `Job`, its root sections, and what their values mean.

The root sections are the frozen dataclasses below; `Job` holds them and the group nodes.
Hydra composes `conf/config.yaml` against an editable copy of them (`hydra_schema`, stored as
`mgpu_schema`), so unknown root keys and wrong types fail at composition. Group nodes
(strategy, model, ...) have no dataclass of their own: the constructor of their `_target_` is
their schema, and they stay plain dicts of its arguments.

This module is the lowest floor of the package: it imports nothing of mgpu, so every part can
read the sections it takes without reaching back into `mgpu.config`, which prepares and checks
a job (and imports the parts it checks).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

GROUPS = (
    "strategy", "precision", "compression", "network", "balance", "model", "data", "optim", "task"
)
FAULT_MODES = ("exception", "sigkill", "hang", "nonfinite_grad", "oom")
SCHEDULE_KINDS = ("sigkill", "exception", "hang", "checkpoint_sigkill")
DIRECTIONS = ("maximize", "minimize")
DERIVED = {"derived": True}  # field metadata: set by `prepare`, not by the user


@dataclass(frozen=True)
class TrainConf:
    """How long to train and how often to log."""

    steps: int = 500  # optimizer steps
    grad_accum: int = 1  # micro-batches per optimizer step
    warmup_steps: int = 20  # steps left out of throughput and step-time figures (<= steps / 2)
    log_every: int = 25  # steps between metric points


@dataclass(frozen=True)
class EvalConf:
    """Evaluation on the validation split."""

    every_steps: int = 100  # 0 = only at the end
    batch_size: int = 512  # per rank


@dataclass(frozen=True)
class LaunchConf:
    """Processes, nodes and the collective timeout."""

    nproc_per_node: Any = "auto"  # "auto" or a positive integer; the number, once prepared
    nnodes: str = "1"  # "N" or "MIN:MAX"
    rdzv_endpoint: str = ""  # host:port; empty = this machine on a free port
    rdzv_timeout_s: int = 600  # how long a node waits at the rendezvous for the others
    # An elastic job (nnodes=MIN:MAX) waits this long for more nodes once MIN are there.
    rdzv_last_call_s: int = 30
    # Seconds between a node's heartbeats; one silent for 3 of them is dropped from the group.
    rdzv_heartbeat_s: int = 5
    max_restarts: int = 0
    timeout_s: int = 300  # collective timeout in seconds
    world_size: int = field(default=0, metadata=DERIVED)  # nodes x processes per node


@dataclass(frozen=True)
class ObjectiveConf:
    """What a job returns to a Hydra sweeper (Optuna), and which way is better."""

    metric: str | None = None  # a summary key; None = the task's own (train: eval/accuracy)
    direction: str = "maximize"  # maximize | minimize: hydra.sweeper.direction must agree


@dataclass(frozen=True)
class TrackingConf:
    """Where and under which names the run is recorded in MLflow."""

    enabled: bool = True
    uri: str | None = None
    experiment: str = "mgpu"
    run_name: str | None = None
    system_metrics: bool = False  # MLflow's own CPU/GPU/memory sampling, logged by rank 0
    objective: ObjectiveConf = field(default_factory=ObjectiveConf)


@dataclass(frozen=True)
class MonitorConf:
    """Optional per-step figures beyond the defaults."""

    enabled: bool = False  # step-phase breakdown, comm timing, telemetry, MFU (mgpu/monitor/)
    interval_s: float = 5.0  # telemetry sampling period
    prometheus_port: int | None = None  # None = no exporter; local rank 0 serves its node's ranks
    prometheus_host: str = "127.0.0.1"  # address the exporter binds to
    profile: bool = False  # torch.profiler over a step window → Chrome trace artifact
    profile_start_step: int = 10  # first profiled step (>= 2)
    profile_steps: int = 3  # profiled steps


@dataclass(frozen=True)
class CheckpointConf:
    """DCP checkpoints: how often, how many, where."""

    every_steps: int = 100  # steps between checkpoints; 0 = none
    keep_last: int = 2  # committed checkpoints kept; older ones are deleted
    async_save: bool = False  # write in the background while training goes on
    dir: str = MISSING  # where checkpoints go (default: <output_dir>/checkpoints)


@dataclass(frozen=True)
class FaultSchedule:
    """Several failures over one run (chaos): restart attempt k fires the k-th, by step."""

    count: int = 0  # faults, at seeded random steps and ranks; 0 = none
    seed: int = 0  # draws each fault's step and rank
    # Taken in turn: fault i is of kind kinds[i % len(kinds)]; checkpoint_sigkill kills its
    # rank while it writes a checkpoint.
    kinds: list[str] = field(default_factory=lambda: list(SCHEDULE_KINDS))


@dataclass(frozen=True)
class FaultConf:
    """A failure injected on purpose, for tests and demonstrations."""

    mode: str | None = None  # None | exception | sigkill | hang | nonfinite_grad | oom
    kill_rank: int = 0
    at_step: int = 0
    every_attempt: bool = False  # fail on restarted attempts too (a rank that always fails)
    schedule: FaultSchedule = field(default_factory=FaultSchedule)


@dataclass(frozen=True)
class StragglerConf:
    """Simulated slow ranks."""

    slowdown: list[float] = field(default_factory=list)  # one factor >= 1 per rank; [] = off
    jitter_s: float = 0.0  # mean of a random (exponential) extra delay per step and rank


@dataclass(frozen=True)
class LossPlateau:
    """Switch once the train loss stops falling: at a log point, the mean train/loss of the last
    `window` steps improved on the mean of the `window` steps before them by less than
    `threshold`, relative to the earlier mean."""

    window: int = 0  # steps per window, a multiple of train.log_every; 0 = off
    threshold: float = 0.01  # relative improvement per window below which the loss has plateaued


@dataclass(frozen=True)
class ThroughputDrop:
    """Switch once training slows down: at a log point, samples/s over the last `window` steps
    fell below `fraction` of the best samples/s over any `window` steps of this process."""

    window: int = 0  # steps per window, a multiple of train.log_every; 0 = off
    fraction: float = 0.5  # of the best window's samples/s, in (0, 1)


@dataclass(frozen=True)
class SwitchWhen:
    """When a run switches strategy: whichever trigger that is set fires first (once)."""

    at_step: int = 0  # after this optimizer step (0 < at_step < train.steps); 0 = off
    loss_plateau: LossPlateau = field(default_factory=LossPlateau)
    throughput_drop: ThroughputDrop = field(default_factory=ThroughputDrop)
    oom: bool = False  # a step fails with torch.OutOfMemoryError: switch from the last checkpoint


@dataclass(frozen=True)
class SwitchConf:
    """Change strategy mid-run: a checkpoint at `when`, the worker group relaunched with `to`."""

    # None = no switch; a strategy option (`fsdp`), or {name: <option>, its keys that differ}.
    # Any: OmegaConf cannot merge a command line's dict into an optional dict that is None.
    to: Any = None
    when: SwitchWhen = field(default_factory=SwitchWhen)
    started_at: float = field(default=0.0, metadata=DERIVED)  # wall clock of the switch's save
    # The run after its switch: its checkpoints record it, so a re-run goes on with `to`.
    switched: bool = field(default=False, metadata=DERIVED)


@dataclass(frozen=True)
class Job:
    """One resolved job: root sections typed, group nodes as the arguments of their class."""

    seed: int = 0
    output_dir: str = MISSING
    resume: str = "auto"  # auto | none | path of a checkpoint
    train: TrainConf = field(default_factory=TrainConf)
    eval: EvalConf = field(default_factory=EvalConf)
    launch: LaunchConf = field(default_factory=LaunchConf)
    tracking: TrackingConf = field(default_factory=TrackingConf)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    fault: FaultConf = field(default_factory=FaultConf)
    monitor: MonitorConf = field(default_factory=MonitorConf)
    straggler: StragglerConf = field(default_factory=StragglerConf)
    switch: SwitchConf = field(default_factory=SwitchConf)
    strategy: dict[str, Any] = MISSING
    precision: dict[str, Any] = MISSING
    compression: dict[str, Any] = MISSING
    network: dict[str, Any] = MISSING
    balance: dict[str, Any] = MISSING
    model: dict[str, Any] = MISSING
    data: dict[str, Any] = MISSING
    optim: dict[str, Any] = MISSING
    task: dict[str, Any] = MISSING

    def groups(self) -> dict[str, dict[str, Any]]:
        """The group nodes by group name, as `Options.of` builds them."""
        return {group: getattr(self, group) for group in GROUPS}

    def as_dict(self) -> dict[str, Any]:
        """Plain nested dicts and lists: for MLflow params and the run's config.yaml."""
        return dataclasses.asdict(self)


@functools.cache
def hydra_schema(cls: type) -> type:
    """`cls` as an editable dataclass without the fields mgpu derives, for Hydra to compose
    against: composition sets values one by one, which a frozen dataclass refuses, and a
    derived field is no option a user may set."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):
            continue
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            fields.append((f.name, hydra_schema(kind), field(default_factory=hydra_schema(kind))))
        elif kind == dict[str, Any]:  # a group node: its own class checks it (check_group)
            fields.append((f.name, Any, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, kind, field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind, f.default))
    return dataclasses.make_dataclass(cls.__name__, fields)


def typed(cls: type, values: dict[str, Any]) -> Any:
    """The dataclass `cls` from nested dicts (its nested dataclass fields built alike)."""
    hints = typing.get_type_hints(cls)
    return cls(**{
        name: typed(hints[name], value) if dataclasses.is_dataclass(hints[name]) else value
        for name, value in values.items()
    })


ConfigStore.instance().store(name="mgpu_schema", node=hydra_schema(Job))


def resolve_tracking_uri(uri: str | None) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else SQLite `mlflow.db` in the working dir."""
    if uri:
        return uri
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
