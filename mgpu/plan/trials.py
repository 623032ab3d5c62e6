"""strategy=auto in the parent, once the job's run exists: optionally time the top predicted
layouts (each a short real run, an MLflow child run tagged `mgpu.trial`), settle on one, and
record the plan (table artifact, choice tags) in the job's run."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.tracking import MlflowClient
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from mgpu import launch, tracking
from mgpu.plan.calibration import errors
from mgpu.plan.planner import Row, format_table
from mgpu.strategy.auto import Planned, with_strategy

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

log = logging.getLogger(__name__)
TABLE_ARTIFACT = "plan/plan.txt"
CHOICE_TAG = "mgpu.plan.choice"
CHOSEN_BY_TAG = "mgpu.plan.chosen_by"


def trial_job(job: Job, row: Row, index: int, steps: int) -> Job:
    """`job` with the row's layout for `steps` steps in a folder of its own: no evaluation on
    the way, no checkpoints, nothing resumed; the first step is warm-up."""
    out = str(Path(job.output_dir) / "trials" / str(index))
    return dataclasses.replace(
        job, strategy=row.candidate.node, output_dir=out, resume="none",
        train=dataclasses.replace(job.train, steps=steps, warmup_steps=1, log_every=steps),
        eval=dataclasses.replace(job.eval, every_steps=0),
        checkpoint=dataclasses.replace(job.checkpoint, every_steps=0, dir=f"{out}/checkpoints"),
    )


def time_trial(job: Job, row: Row, index: int, steps: int, run_id: str | None,
               env: dict[str, str]) -> float | None:
    """The layout's measured median step time over a short real run (None if it failed, e.g.
    out of memory: the plan goes on without it)."""
    trial = trial_job(job, row, index, steps)
    uri = job.tracking.uri
    child = None
    if run_id:
        child = tracking.start_trial_run(uri, run_id, f"trial {index}: {row.candidate.name}",
                                         row.candidate.name)
    try:
        results = launch.launch(trial, child, env)
    except ChildFailedError as e:
        log.warning("trial %d (%s) failed: %s", index, row.candidate.name,
                    launch.describe_failure(e, trial))
        if child:
            tracking.finish_run(uri, child, "FAILED", trial.output_dir)
        return None
    summary = results[min(results)]
    if child:
        tracking.log_metrics(uri, child, errors(row, summary), steps, trial.output_dir)
        tracking.finish_run(uri, child, "FINISHED", trial.output_dir)
    return summary.get("time/step_p50_s")


def settle(job: Job, options: Options, run_id: str | None, env: dict[str, str]
           ) -> tuple[Job, Options]:
    """The planned job, its layout the fastest measured of the top `trials` predicted ones
    that fit (the first predicted without trials); the plan recorded in the job's run."""
    planned = options.planned
    chosen, chosen_by = planned.rows[0], "prediction"
    top = [row for row in planned.rows if row.fits][: planned.auto.trials]
    timed = [(time_trial(job, row, i, planned.auto.trial_steps, run_id, env), row)
             for i, row in enumerate(top)]
    measured = [(seconds, row) for seconds, row in timed if seconds]
    if measured:
        chosen, chosen_by = min(measured, key=lambda pair: pair[0])[1], "trials"
    if run_id:
        record(job, run_id, planned, chosen, chosen_by)
    log.info("strategy=auto chose %s (by %s)", chosen.candidate.name, chosen_by)
    return with_strategy(job, chosen.candidate.node, planned)


def record(job: Job, run_id: str, planned: Planned, chosen: Row, chosen_by: str) -> None:
    """The ranked table as an artifact, the choice and how it was made as tags."""
    client = MlflowClient(job.tracking.uri)
    header = (f"memory limit {planned.memory_limit:.0f} bytes per rank; compute "
              f"{planned.machine.flops_per_s:.3g} FLOP/s per rank; links: "
              f"{planned.machine.source}\n")
    client.log_text(run_id, header + format_table(planned.rows) + "\n", TABLE_ARTIFACT)
    client.set_tag(run_id, CHOICE_TAG, chosen.candidate.name)
    client.set_tag(run_id, CHOSEN_BY_TAG, chosen_by)
