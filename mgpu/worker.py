"""Per-rank entry point. Lives outside `__main__` so spawned processes can import it."""

from __future__ import annotations

import logging
import os
import signal

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from mgpu import checkpoint, tracking
from mgpu.config import Job, Options
from mgpu.monitor.system import system_metrics
from mgpu.runtime import Runtime, init_runtime, shutdown

log = logging.getLogger("mgpu.worker")


@record
def main(job: Job, run_id: str | None, env: dict[str, str] | None = None) -> dict[str, float]:
    """Started by the elastic agent on every rank: apply the network settings, join, run the task.

    `env` is set here rather than inherited: workers fork from a server started once per
    process, so a sweep's later jobs would otherwise see the first job's settings.
    """
    os.environ.update(env or {})
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


def main_under_torchrun(
    job: Job, options: Options, choices: dict[str, str], overrides: list[str]
) -> dict:
    """torchrun started this process: rank 0 owns the MLflow run, which no parent holds here.

    `options` are the ones this process built to check its config: each rank composed the
    same command line, so they are the same on every rank."""
    env = options.network.env()
    os.environ.update(env)  # before the process group reads it
    runtime = init_runtime(job.output_dir, job.launch.timeout_s)
    try:
        if dist.is_initialized():
            # Each rank composed its own config; rank 0's (output dir, timestamps) is the run's.
            shared = [job]
            dist.broadcast_object_list(shared, src=0)
            job = shared[0]
        if not (runtime.is_main and job.tracking.enabled):
            return start_task(job, options, runtime, None)
        uri = job.tracking.uri
        resumed = tracking.continue_run(uri, checkpoint.resumed_run_id(job.checkpoint, job.resume))
        run_id = resumed or tracking.start_job_run(
            job, choices, overrides, tracking.data_params(options.data))
        if not resumed:
            tracking.log_env(uri, run_id, env)
        # torchrun ends a failed group with SIGTERM: turn it into an exception so the run closes.
        signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            with system_metrics(job.tracking, job.monitor.interval_s, run_id):
                summary = start_task(job, options, runtime, run_id)
        except BaseException as e:
            tracking.finish_run(uri, run_id, "FAILED", error=f"rank 0: {type(e).__name__}: {e}")
            raise
        tracking.finish_run(uri, run_id, "FINISHED")
        return {**summary, "run_id": run_id}
    finally:
        shutdown()


def _raise_terminated(signum: int, frame: object) -> None:
    raise SystemExit(f"terminated by the launcher (signal {signum}): another rank failed")
