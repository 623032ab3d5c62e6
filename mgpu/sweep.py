"""A sweep's MLflow parent run (`python -m mgpu -m ...`): opened before the first job, given
the sweep's comparison (`mgpu.report`) after the last, closed with the sweep's status."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from mgpu.errors import ConfigError
from mgpu.job import resolve_tracking_uri
from mgpu.options import build
from mgpu.tracking import (
    MAX_RUN_NAME_LENGTH,
    PARENT_RUN_ENV,
    PARENT_URI_ENV,
    experiment_id,
    first_line,
    mask_override,
    shortened,
    tags_within_limits,
)

log = logging.getLogger("mgpu.sweep")


class SweepRunCallback(Callback):
    """In a multirun, one MLflow parent run holds the sweep; each job's run is its child."""

    def __init__(self) -> None:
        self.uri: str | None = None
        self.failed_jobs = 0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        tracking = config.tracking
        if not tracking.enabled:
            return
        objective = tracking.objective
        try:
            check_sweeper_direction(config.hydra.sweeper, objective.direction, objective.metric)
        except ConfigError:
            # Hydra only warns about an error raised here: the first job refuses the sweep,
            # which has no parent run.
            return
        self.uri = resolve_tracking_uri(tracking.uri)
        # Creating the store here, once, keeps parallel jobs from racing on its migration.
        client = MlflowClient(self.uri)
        overrides = [mask_override(o) for o in OmegaConf.to_container(config.hydra.overrides.task)]
        run = client.create_run(
            experiment_id(client, tracking.experiment),
            run_name=shortened(f"sweep {' '.join(overrides)}", MAX_RUN_NAME_LENGTH),
            tags=tags_within_limits({
                "mgpu.sweep_dir": str(config.hydra.sweep.dir),
                "mgpu.overrides": " ".join(overrides),
            }),
        )
        os.environ[PARENT_RUN_ENV] = run.info.run_id
        os.environ[PARENT_URI_ENV] = self.uri

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if job_return.status.name == "FAILED":
            self.failed_jobs += 1

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        run_id = os.environ.get(PARENT_RUN_ENV)
        if run_id and self.uri:
            self.summarize(config, run_id)
        end_sweep_run("FAILED" if self.failed_jobs else "FINISHED")

    def summarize(self, config: DictConfig, run_id: str) -> None:
        """The comparison on the parent run (`mgpu.report`); a sweep that trained does not
        fail for want of its summary."""
        from mgpu.report import summarize_sweep  # plots: the parent of a sweep only

        objective = config.tracking.objective
        metric = objective.metric or build(OmegaConf.to_container(config.task)).objective
        out = Path(config.hydra.sweep.dir) / "report"
        try:
            summarize_sweep(self.uri, run_id, metric, objective.direction, out)
        except (Exception, SystemExit) as e:
            log.warning("the sweep's summary was not logged to its parent run: %s",
                        first_line(e) if isinstance(e, Exception) else e)


def check_sweeper_direction(sweeper: DictConfig, direction_wanted: str, metric: str | None) -> None:
    """A sweeper that optimises (Optuna) must go the objective's way (`tracking.objective`):
    Optuna's default, minimize, against eval/accuracy would search for the worst run."""
    direction = OmegaConf.select(sweeper, "direction")
    if direction is None:
        return  # a sweeper that does not optimise (Hydra's basic grid)
    direction = getattr(direction, "name", direction)  # Optuna's Direction enum or its name
    if not isinstance(direction, str) or direction == direction_wanted:
        return  # several directions: a multi-objective study, which mgpu returns no values for
    raise ConfigError(
        f"hydra.sweeper.direction={direction} but tracking.objective.direction="
        f"{direction_wanted} ({metric}): the sweep would search for the worst run; set "
        f"hydra.sweeper.direction={direction_wanted}, or use experiment=optuna, which takes "
        f"tracking.objective.direction"
    )


def end_sweep_run(status: str) -> None:
    """Close the sweep's parent run, if one is open in this process.

    Hydra skips `on_multirun_end` when a job failed, so the entry point calls this on errors.
    """
    run_id = os.environ.pop(PARENT_RUN_ENV, None)
    uri = os.environ.pop(PARENT_URI_ENV, None)
    if run_id and uri:
        MlflowClient(uri).set_terminated(run_id, status)
