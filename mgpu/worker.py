"""Per-rank entry point. Lives outside `__main__` so spawned processes can import it."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from mgpu import checkpoint, elastic, tracking
from mgpu.job import Job
from mgpu.monitor.system import node_id, system_metrics
from mgpu.network.topology import TOPOLOGY_FILE
from mgpu.options import Options
from mgpu.runtime import Runtime, init_runtime, join_group, setup_logging, shutdown

log = logging.getLogger("mgpu.worker")


@record
def main(
    job: Job, run_id: str | None, env: dict[str, str] | None = None,
    request: RunRequest | None = None,
) -> dict[str, float] | Outcome:
    """Started by the elastic agent on every rank: apply the network settings, join, run the task.

    `env` is set here rather than inherited: workers fork from a server started once per
    process, so a sweep's later jobs would otherwise see the first job's settings. With a
    `request` (a multi-node job) no parent holds the run: global rank 0 opens it and hands
    its job to every rank (`run_owned_by_rank0`).
    """
    os.environ.update(env or {})
    if request is not None:
        return run_owned_by_rank0(job, Options.of(job.groups()), request, env or {})
    # The launcher ends a failed group with SIGTERM: an exception, so the task closes (its
    # last metric points written) on its way out. Quietly: the parent names the failure.
    signal.signal(signal.SIGTERM, _exit_terminated)
    runtime = init_runtime(job.output_dir, job.launch.timeout_s)
    try:
        return start_task(job, Options.of(job.groups()), runtime, run_id)
    finally:
        shutdown()


def start_task(
    job: Job, options: Options, runtime: Runtime, run_id: str | None
) -> dict[str, float]:
    """The job's task on this rank: train (the default) or another, e.g. task=commbench."""
    return options.task.run(job, options, runtime, run_id)


@dataclass(frozen=True)
class RunRequest:
    """What global rank 0 needs to open the job's MLflow run where no parent holds it (under
    torchrun, and in a multi-node job, whose parents cannot know which node holds rank 0)."""

    choices: dict[str, str]
    overrides: list[str]


@dataclass(frozen=True)
class Outcome:
    """A rank's result in a job whose run global rank 0 owns: its task's summary, and rank 0's
    job (output dir), run id and host, which every rank ran with."""

    rank: int
    summary: dict[str, float]
    job: Job
    run_id: str | None
    owner: str


def main_under_torchrun(
    job: Job, options: Options, choices: dict[str, str], overrides: list[str]
) -> Outcome:
    """torchrun started this process: rank 0 owns the MLflow run, which no parent holds here.

    `options` are the ones this process built to check its config: each rank composed the
    same command line, so they are the same on every rank."""
    env = options.network.env()
    os.environ.update(env)  # before the process group reads it
    return run_owned_by_rank0(job, options, RunRequest(choices, overrides), env)


def run_owned_by_rank0(
    job: Job, options: Options, request: RunRequest, env: dict[str, str]
) -> Outcome:
    """Rank 0 opens (or continues) the run and hands its job, run id and host to every rank,
    so all write into its output and checkpoint dirs; it closes the run FINISHED or FAILED."""
    runtime = join_group(job.output_dir, job.launch.timeout_s)
    try:
        run_id = membership = None
        if runtime.is_main:
            if job.tracking.enabled:
                run_id = open_run(job, options, request, env)
            membership = elastic.begin_group(job.output_dir, runtime.world_size, run_id)
        job, run_id, owner, membership = rank0s(
            [job, run_id, socket.gethostname(), membership])
        runtime = dataclasses.replace(
            runtime, output_dir=Path(job.output_dir), membership=membership)
        setup_logging(runtime.rank, runtime.output_dir)
        if not (runtime.is_main and run_id):
            sampled = run_id if runtime.local_rank == 0 else None  # one sampler per node
            with system_metrics(job.tracking, job.monitor.interval_s, sampled, node_id()):
                summary = start_task(job, options, runtime, None)
            return Outcome(runtime.rank, summary, job, run_id, owner)
        uri = job.tracking.uri
        # The launcher ends a failed group with SIGTERM: an exception, so the run closes.
        signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            with system_metrics(job.tracking, job.monitor.interval_s, run_id, node_id()):
                summary = start_task(job, options, runtime, run_id)
        except BaseException as e:
            # Where the agent may start another group (a node joins, or a retry), that group
            # continues the run; where it gives up, the nodes' parents close it.
            if not elastic.may_restart(job.launch):
                tracking.finish_run(uri, run_id, "FAILED", job.output_dir,
                                    error=f"rank 0: {type(e).__name__}: {e}")
            raise
        tracking.finish_run(uri, run_id, "FINISHED", job.output_dir)
        return Outcome(runtime.rank, summary, job, run_id, owner)
    finally:
        shutdown()


def open_run(job: Job, options: Options, request: RunRequest, env: dict[str, str]) -> str:
    """Rank 0: the run of the job's earlier worker groups (an elastic restart, which may come
    before any checkpoint), else the run its checkpoint was saved by, else a new one."""
    uri = job.tracking.uri
    earlier = elastic.job_run(job.output_dir) or checkpoint.resumed_run_id(
        job.checkpoint, job.resume)
    resumed = tracking.continue_run(uri, earlier)
    if resumed:
        return resumed
    run_id = tracking.start_job_run(
        job, request.choices, request.overrides, tracking.data_params(options.data))
    tracking.log_env(uri, run_id, env, job.output_dir, Path(job.output_dir) / TOPOLOGY_FILE)
    return run_id


def rank0s(objects: list) -> list:
    """Rank 0's `objects` on every rank."""
    if dist.is_initialized():
        dist.broadcast_object_list(objects, src=0)
    return objects


def _raise_terminated(signum: int, frame: object) -> None:
    raise SystemExit(f"terminated by the launcher (signal {signum}): another rank failed")


def _exit_terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the status of a process the signal ended
