"""`python -m mgpu`: compose → validate → track → launch → finish."""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from mgpu import checkpoint, launch, rendezvous, sweep, tracking, worker
from mgpu.config import prepare
from mgpu.errors import ConfigError, RunFailed
from mgpu.job import GROUPS, Job
from mgpu.monitor.system import system_metrics
from mgpu.network.topology import TOPOLOGY_FILE
from mgpu.options import Options
from mgpu.plan import calibration, trials
from mgpu.task import Task

# Read before `main` sets the variable for Hydra: whether the user asked for tracebacks.
SHOW_TRACEBACK = os.environ.get("HYDRA_FULL_ERROR") == "1"


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def app(cfg: DictConfig) -> float:
    try:
        return launch_one_job(cfg)
    except (ConfigError, RunFailed) as e:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # Hydra records the failed job and goes on with the sweep
        exit_with(e)  # here, not in `main`: Hydra would first print a line of its own


def launch_one_job(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    tagged = (*GROUPS, "experiment")
    choices = {g: str(o) for g, o in hydra_cfg.runtime.choices.items() if g in tagged and o}
    overrides = list(hydra_cfg.overrides.task)
    torchrun = launch.torchrun_world()
    job, options = prepare(cfg, torch.cuda.device_count(), torchrun)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep.check_sweeper_direction(
            hydra_cfg.sweeper, job.tracking.objective.direction, objective_metric(job, options))
    if torchrun:
        outcome = worker.main_under_torchrun(job, options, choices, overrides)
        if outcome.rank == 0:
            report(outcome.job, outcome.run_id, outcome.summary, options.task)
        return objective(job, options, outcome.summary)

    uri = job.tracking.uri
    if job.tracking.enabled:
        tracking.check_reachable(uri)
    env = options.network.prepare_node(Path(job.output_dir))
    if launch.multi_node(job):
        return launch_on_many_nodes(job, options, env, worker.RunRequest(choices, overrides))
    run_id = resumed = None
    if job.tracking.enabled:
        resumed = tracking.continue_run(uri, checkpoint.resumed_run_id(job.checkpoint, job.resume))
        run_id = resumed or tracking.create_job_run(job, choices, overrides)
    if options.planned is not None and not resumed:  # strategy=auto: trials, then its choice
        job, options = trials.settle(job, options, run_id, env)
    if run_id and not resumed:
        tracking.log_job_config(job, run_id, tracking.data_params(options.data))
        tracking.log_env(uri, run_id, env, job.output_dir, Path(job.output_dir) / TOPOLOGY_FILE)
    prediction = None
    if getattr(options.task, "trains", False):  # the planner's figures beside the measured
        prediction = calibration.predict_own(job, options, torch.cuda.device_count())
        if run_id:
            tracking.log_metrics(uri, run_id, calibration.predicted(prediction), 0,
                                 job.output_dir)
    try:
        # Sampled here, off the training ranks.
        with system_metrics(job.tracking, job.monitor.interval_s, run_id):
            results = launch.launch(job, run_id, env)
    except BaseException as e:
        failed = isinstance(e, ChildFailedError)
        error = launch.describe_failure(e, job) if failed else f"{type(e).__name__}: {e}"
        if run_id:
            tracking.finish_run(uri, run_id, "FAILED" if failed else "KILLED", job.output_dir,
                                error=error)
        if failed:
            raise RunFailed(f"{error} (logs: {job.output_dir}/logs)") from None
        raise
    summary = results[min(results)]
    if prediction is not None and "switch/at_step" not in summary:  # switched: two layouts
        figures = calibration.errors(prediction, summary)
        summary = {**summary, **figures}
        if run_id:
            tracking.log_metrics(uri, run_id, figures, int(summary.get("step", 0)),
                                 job.output_dir)
    if run_id:
        tracking.finish_run(uri, run_id, "FINISHED", job.output_dir)
    report(job, run_id, summary, options.task)
    return objective(job, options, summary)


def launch_on_many_nodes(
    job: Job, options: Options, env: dict[str, str], request: worker.RunRequest
) -> float:
    """This node's part of a multi-node job: global rank 0 owns the run and every rank runs
    its job; the parent of its node reports, the others say where the results are."""
    if job.launch.rdzv_endpoint:
        rendezvous.meet(job)  # enough nodes, all with one config: else one line on each
    try:
        results = launch.launch(job, None, env, request)
    except BaseException as e:
        failed = isinstance(e, ChildFailedError)
        error = launch.describe_failure(e, job) if failed else f"{type(e).__name__}: {e}"
        if job.tracking.enabled:  # where rank 0 died before it could close the run
            tracking.close_running(job.tracking.uri, job.tracking.experiment, job.output_dir,
                                   "FAILED" if failed else "KILLED", error)
        if failed:
            raise RunFailed(f"{error} (logs: {job.output_dir}/logs)") from None
        raise
    outcome = results[min(results)]
    if outcome.rank == 0:
        report(outcome.job, outcome.run_id, outcome.summary, options.task)
    else:
        print(f"mgpu: done on this node (ranks {min(results)}-{max(results)}); node "
              f"{outcome.owner} holds rank 0 and reports the run: outputs "
              f"{outcome.job.output_dir}, MLflow run {outcome.run_id}")
    return objective(job, options, outcome.summary)


def objective(job: Job, options: Options, summary: dict[str, float]) -> float:
    """The value a Hydra sweeper optimises: `tracking.objective.metric`, else the task's own
    (eval/accuracy for train). Its direction is the sweeper's to know (`experiment=optuna`)."""
    metric = objective_metric(job, options)
    if metric not in summary:
        raise ConfigError(
            f"tracking.objective.metric={metric}: not in the run's summary; use one of "
            f"{', '.join(sorted(summary))}"
        )
    return summary[metric]


def objective_metric(job: Job, options: Options) -> str:
    return job.tracking.objective.metric or options.task.objective


def report(job: Job, run_id: str | None, summary: dict[str, float], task: Task) -> None:
    """Write summary.json and tell the user where the results are (what the task wrote) and
    how to open them."""
    out = Path(job.output_dir)
    (out / "summary.json").write_text(json.dumps({"run_id": run_id, **summary}, indent=2))
    # A user's own task that names no outputs has what every task has.
    written = getattr(task, "outputs", ("summary.json", "logs/"))
    print(
        f"mgpu: done. {task.summary_line(summary)}\n"
        f"  outputs: {out} ({', '.join(written)})"
    )
    spool = tracking.Spool(out)
    if run_id and spool.pending():
        print(f"  MLflow:  unreachable: what run {run_id} could not write is kept in "
              f"{spool.path}; once MLflow is back: python -m mgpu.tracking sync {out}")
    elif run_id:
        experiment = MlflowClient(job.tracking.uri).get_run(run_id).info.experiment_id
        print(
            f"  MLflow:  run {run_id} in experiment '{job.tracking.experiment}' "
            f"at {job.tracking.uri}\n"
            f"  open:    make ui, then http://127.0.0.1:5000/#/experiments/{experiment}/runs/{run_id}"
        )


def one_line(error: BaseException) -> str:
    """A user mistake as one line: the key, what is wrong, and what is valid."""
    if isinstance(error, MissingConfigException) and error.options:
        first = str(error).strip().splitlines()[0]
        return f"{first}; available: {', '.join(error.options)}"
    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        message = f"{cause.full_key}: {cause.msg.strip().splitlines()[0]}"
        unknown_key = isinstance(cause, (ConfigKeyError, ConfigAttributeError))
        if unknown_key and isinstance(cause.parent_node, DictConfig):
            valid = [str(k) for k in cause.parent_node if not str(k).startswith("_")]
            message += f"; valid keys: {', '.join(valid)}"
        return message
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines)


def main() -> None:
    """Entry point: user mistakes end as one line and a non-zero exit, bugs as a traceback.

    On the way out the objects this process holds are frozen out of the garbage collector:
    the interpreter's last collection walks every one of them (torch, MLflow, Hydra) and took
    2.2-2.4 s after the closing lines on the 2-core machine, which a user waited through for
    nothing. Only reference cycles go uncollected then: the run is closed and its files
    written by then, and the process's memory is returned as it ends."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach this handler instead of Hydra's
    tracking.short_http_retries()  # for this process and its workers
    try:
        app()
    except (ConfigError, RunFailed, HydraException, OmegaConfBaseException) as e:
        sweep.end_sweep_run("FAILED")
        exit_with(e)
    except BaseException:
        sweep.end_sweep_run("FAILED")
        raise
    finally:
        gc.freeze()


def exit_with(error: BaseException) -> NoReturn:
    """One line and exit code 2 for a user mistake, 1 for a failed run; the traceback first
    where the user asked for it (`HYDRA_FULL_ERROR=1`)."""
    if SHOW_TRACEBACK:
        traceback.print_exception(error)
    kind = "run failed" if isinstance(error, RunFailed) else "config error"
    print(f"mgpu: {kind}: {one_line(error)}", file=sys.stderr)
    sys.exit(1 if isinstance(error, RunFailed) else 2)


if __name__ == "__main__":
    main()
