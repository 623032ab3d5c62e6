"""Starting the worker group: elastic_launch (the engine behind torchrun), or torchrun itself."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import re
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mgpu import fault, worker
from mgpu.elastic import parse_nnodes
from mgpu.job import FaultConf, Job, SwitchConf
from mgpu.meter import JOB_PID_ENV
from mgpu.options import option_name

# Restarted groups on gloo reuse stale peer addresses from the shared rendezvous store
# (pytorch issue #135712); a fresh store per attempt makes restarts reliable.
# MKL's CPU matrix products may round differently with the alignment of their buffers, which
# differs between processes: PowerSGD rebuilds each rank's gradient as the product of the same
# two all-reduced factors, and replicas drifted apart by an ulp. Strict conditional numerical
# reproducibility makes the same product the same on every rank.
WORKER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "MKL_CBWR": "AUTO,STRICT"}
log = logging.getLogger(__name__)


def torchrun_world() -> tuple[int, int] | None:
    """(world size, local world size) when torchrun started this process, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return None


def multi_node(job: Job) -> bool:
    """Whether the job may span several nodes: then no parent holds its run (global rank 0
    does), since none can know before the rendezvous whether its node holds rank 0."""
    return parse_nnodes(job.launch.nnodes)[1] > 1


def launch(
    job: Job, run_id: str | None, env: dict[str, str],
    request: worker.RunRequest | None = None,
) -> dict[int, Any]:
    """Run `worker.main` on every local rank; returns {global rank: its result}: a summary,
    or with a `request` (a multi-node job: rank 0 opens the run) a `worker.Outcome`.

    `env` (the network group's settings) goes to the workers, which set it before any
    communication library reads it, with the job's own flight-recorder paths. Neither is set
    in this process: the fork server, started once, would keep the first job's settings for
    every later job of a sweep. What is set here (`WORKER_ENV`, the job's root process) is the
    same for every job.
    """
    # Workers fork from a server that has imported the worker code (and the default task's)
    # once per sweep, not per job; unlike plain fork, it holds no state of this process
    # (MLflow's database handles).
    multiprocessing.set_forkserver_preload(["mgpu.worker", "mgpu.task.train"])
    settings = job.launch
    min_nodes, max_nodes = parse_nnodes(settings.nnodes)
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=settings.nproc_per_node,
        run_id="mgpu",
        rdzv_backend="c10d",
        rdzv_endpoint=settings.rdzv_endpoint or "127.0.0.1:0",
        rdzv_configs={
            "join_timeout": settings.rdzv_timeout_s,
            "last_call_timeout": settings.rdzv_last_call_s,
            "keep_alive_interval": settings.rdzv_heartbeat_s,
        },
        max_restarts=settings.max_restarts,
        monitor_interval=0.1,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=str(elastic_log_dir(job))),
    )
    # process_env is set in this process, for the agent and the fork server: the same for every
    # job it launches (the job's own processes are this one and those under it, as
    # `mgpu.meter.OtherLoad` counts them). job_env goes to the workers, which set it.
    process_env = {**WORKER_ENV, JOB_PID_ENV: str(os.getpid())}
    job_env = {**env, **flight_recorder_env(job.output_dir)}
    failed_at = None
    with environment(process_env), agent_logs_to(elastic_log_dir(job) / "agent.log"), \
            start_method(config.start_method):
        try:
            results = elastic_launch(config, worker.main)(job, run_id, job_env, request)
        except ChildFailedError as error:
            if not switches_on_failure(error, job):
                raise
            failed_at = time.time()
    if failed_at is not None:  # out of memory: the new strategy from the last checkpoint
        return launch(switched(job, failed_at, after_failure=True), run_id, env, request)
    summary = group_summary(results)
    if job.switch.to is None or "switch/started_at" not in summary:  # none fired
        return results
    return launch(switched(job, summary["switch/started_at"]), run_id, env, request)


def group_summary(results: dict[int, Any]) -> dict[str, float]:
    """The summary of the group's first rank."""
    first = results[min(results)]
    return first.summary if isinstance(first, worker.Outcome) else first


def switched(job: Job, started_at: float, after_failure: bool = False) -> Job:
    """The job after its switch, which began at `started_at` (wall clock): the new strategy,
    resuming the newest checkpoint (the one the old strategy wrote at the switch's step, the
    last before its failure, or a later one of the new strategy's where an earlier invocation
    switched already) in the same run; no further switch. A switch `after_failure` runs the
    group again, so an injected fault fails it only `every_attempt`, as on a restart."""
    fault = job.fault if job.fault.every_attempt or not after_failure else FaultConf()
    return dataclasses.replace(
        job, strategy=job.switch.to, resume="auto", fault=fault,
        switch=SwitchConf(when=job.switch.when, started_at=started_at, switched=True))


# A rank's error report where it ran out of device memory (the type name torch raises).
OUT_OF_MEMORY = re.compile(r"\bOutOfMemoryError\b")


def switches_on_failure(error: ChildFailedError, job: Job) -> bool:
    """Whether the group's failure switches the run (`switch.when.oom`): a rank ran out of
    memory, by its own error report (its peers then fail for lack of it). The launcher sees
    every rank's failure, so the whole group is relaunched: no rank switches alone."""
    if job.switch.to is None or not job.switch.when.oom:
        return False
    causes = root_causes(failure_reports(error, job))
    out_of_memory = {rank: line for rank, line in causes.items() if OUT_OF_MEMORY.search(line)}
    if not out_of_memory:
        return False
    rank = min(out_of_memory)
    log.warning("rank %d ran out of memory (%s): switching to strategy=%s from the last "
                "checkpoint", rank, out_of_memory[rank],
                option_name("strategy", job.switch.to["_target_"]))
    return True


@contextmanager
def start_method(method: str):
    """This process's default start method set to the launch's own, then restored.

    A child of the fork server sets the start method its parent had by default; under Hydra's
    joblib launcher that is loky's, which only loky's processes know: without this, every
    worker died with "cannot find context for 'loky'" before reaching mgpu's code.
    """
    saved = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(saved, force=True)


# The loggers of torch's elastic agent and of the processes it starts and stops.
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@contextmanager
def agent_logs_to(path: Path):
    """Write what the elastic agent logs (a failed rank's traceback, the ranks it terminates)
    into `path` instead of the console, where a failure is one line naming where to look."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.handlers[:] = [handler]
        logger.propagate = False
    try:
        yield
    finally:
        for logger, (handlers, propagate) in zip(loggers, saved, strict=True):
            logger.handlers[:] = handlers
            logger.propagate = propagate
        handler.close()


def elastic_log_dir(job: Job) -> Path:
    """Where the agent of this node keeps its workers' output and error reports: one folder
    per node in a multi-node job, whose nodes share the output dir."""
    log_dir = Path(job.output_dir, "logs", "elastic")
    return log_dir / f"{socket.gethostname()}-{os.getpid()}" if multi_node(job) else log_dir


def flight_recorder_env(output_dir: str) -> dict[str, str]:
    """On CUDA: on a collective timeout, NCCL's flight recorder dumps each rank's recent
    collectives into `logs/nccl_trace_rank_<r>` (which rank never joined which collective)."""
    if not torch.cuda.is_available():
        return {}
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(output_dir, "logs", "nccl_trace_rank_"),
    }


@contextmanager
def environment(variables: dict[str, str]):
    """Set `variables` for the agent and the workers started inside, then restore: the fork
    server, started by a process's first launch, keeps them for every later one."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Errors a rank reports when a peer died first: consequences, not causes.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "terminated by the launcher")
# ... or when a peer stopped answering for launch.timeout_s (gloo: "Timed out", NCCL: "timeout").
TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def describe_failure(error: ChildFailedError, job: Job) -> str:
    """One line naming the rank whose failure stopped the group, and its error.

    The agent reports only the first process it saw exit, often a rank that merely lost its
    peer ("connection reset"). Every rank's own error report is in the elastic log dir, so the
    root cause is looked up there; a rank with no report died without Python (a signal).
    The agent names its failures by global rank, the log dir this node's processes by local
    rank: this node's first global rank turns one into the other (on node 0 they agree).
    """
    first = node_first_rank(error)
    reports = failure_reports(error, job)
    causes = root_causes(reports)
    if causes:
        rank = min(causes)
        signal_name = KILLED.search(causes[rank])
        if signal_name:
            return f"rank {rank} was killed by {signal_name[1]}{_at_step(job, rank)}"
        return f"rank {rank} failed: {causes[rank]}"
    silent = sorted(set(range(first, first + job.launch.nproc_per_node)) - set(reports))
    timeouts = [m for m in reports.values() if TIMED_OUT.search(m)]
    if silent and timeouts:  # the peers waited in a collective for a rank that never came
        return (
            f"rank {silent[0]} hung{_at_step(job, silent[0], timeouts[0])}: its peers timed out "
            f"after launch.timeout_s={job.launch.timeout_s} s waiting for it"
        )
    if silent:
        return (
            f"rank {silent[0]} died without an error report{_at_step(job, silent[0])} "
            f"(killed by a signal?); its peers then failed: {reports[min(reports)]}"
        )
    rank = min(reports)
    return f"rank {rank} failed: {reports[rank]}"


def failure_reports(error: ChildFailedError, job: Job) -> dict[int, str]:
    """{global rank: the last line of its error}: the agent's, replaced by the rank's own
    report in the elastic log dir where it wrote one."""
    first = node_first_rank(error)
    reports = {rank: _last_line(failure.message) for rank, failure in error.failures.items()}
    local_reports = _error_reports(elastic_log_dir(job))
    reports.update({first + local: message for local, message in local_reports.items()})
    return reports


def root_causes(reports: dict[int, str]) -> dict[int, str]:
    """The reports that are causes: not a rank that lost its peer or timed out waiting."""
    return {r: m for r, m in reports.items()
            if not any(p in m for p in PEER_LOST) and not TIMED_OUT.search(m)}


# The agent's report of a rank ended by a signal: "Signal 9 (SIGKILL) received by PID 123".
KILLED = re.compile(r"Signal \d+ \((SIG\w+)\) received")


def _at_step(job: Job, rank: int, peer_said: str = "") -> str:
    """" at step N": the step the rank last started (its `fault.StepMark`), else the step its
    peer's error names (the step they waited at), else ""."""
    step = fault.read_step(fault.step_file(job.output_dir, rank))
    if step is None:
        named = re.search(r"at step (\d+)", peer_said)
        step = int(named[1]) if named else None
    return f" at step {step}" if step else ""


def node_first_rank(error: ChildFailedError) -> int:
    """The global rank of this node's local rank 0, from a failure the agent reported (each
    knows both its global and its local rank); 0 where it reported none."""
    for rank, failure in error.failures.items():
        return rank - failure.local_rank
    return 0


def _error_reports(log_dir: Path) -> dict[int, str]:
    """{local rank: last line of its error} from the newest attempt's error files: the one
    started last (a switched run launches its group again into the same folder)."""
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: p.stat().st_mtime_ns)
    if not attempts:
        return {}
    reports = {}
    for path in attempts[-1].glob("*/error.json"):
        message = json.loads(path.read_text()).get("message", "")
        if isinstance(message, dict):
            message = message.get("message", "")
        reports[int(path.parent.name)] = _last_line(message)
    return reports


def _last_line(message: object) -> str:
    if isinstance(message, dict):
        message = message.get("message", str(message))
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no error message"
