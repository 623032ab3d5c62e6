"""Sweeps through Hydra's own plugins (the `cluster` extra): the joblib and submitit launchers
and the Optuna sweeper, each job a FINISHED child of the sweep's one MLflow parent run."""

from __future__ import annotations

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import mlflow_runs

pytestmark = pytest.mark.e2e

# A few steps of one process: these runs check the plumbing, not the training.
TINY = ["train.steps=4", "train.warmup_steps=1", "train.log_every=2", "eval.every_steps=0",
        "checkpoint.every_steps=0"]


def sweep_children(tmp_path, jobs: int) -> list:
    """The sweep's child runs, after checking there is one parent and `jobs` children, all
    FINISHED, each pointing at the parent."""
    runs = mlflow_runs(tmp_path)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == jobs, [r.data.tags for r in runs]
    assert [r.info.status for r in runs] == ["FINISHED"] * len(runs)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert len({r.data.tags["mgpu.output_dir"] for r in children}) == jobs
    return children


def test_joblib_runs_two_jobs_at_once(cli, tmp_path):
    """joblib's workers run under loky's start method, which mgpu's launch must not inherit."""
    result = cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *TINY,
                 "launch.nproc_per_node=1", "optim.lr=1e-3,3e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    children = sweep_children(tmp_path, 2)
    assert {r.data.params["optim.lr"] for r in children} == {"0.001", "0.003"}
    # The parent holds the comparison: the report, the best job, what every job shared.
    [parent] = [r for r in mlflow_runs(tmp_path) if "mlflow.parentRunId" not in r.data.tags]
    best = max(children, key=lambda r: r.data.metrics["eval/accuracy"])
    assert parent.data.tags["mgpu.best_run"] == best.info.run_id
    assert parent.data.tags["mgpu.best_job"] == f"optim.lr={best.data.params['optim.lr']}"
    assert parent.data.metrics["best/eval/accuracy"] == best.data.metrics["eval/accuracy"]
    assert parent.data.params["train.steps"] == "4" and "optim.lr" not in parent.data.params
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/report.csv"} <= logged


def test_slurm_preset_maps_the_allocation_to_launch_keys(cli, tmp_path):
    """experiment=slurm run through submitit's local executor: each job is one allocation of
    hydra.launcher.nodes nodes with gpus_per_node processes each."""
    result = cli("-m", "experiment=slurm", "hydra/launcher=submitit_local",
                 "hydra.launcher.gpus_per_node=2", *TINY, "optim.lr=1e-3,3e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    children = sweep_children(tmp_path, 2)
    for run in children:
        params = run.data.params
        assert (params["launch.nnodes"], params["launch.nproc_per_node"]) == ("1", "2")
        assert params["launch.world_size"] == "2"
    assert {r.data.params["optim.lr"] for r in children} == {"0.001", "0.003"}


def test_optuna_preset_minimizes_the_chosen_objective(cli, tmp_path):
    """The value a job returns is tracking.objective.metric, and the preset hands its
    direction to Optuna: the best trial is the child run with the lowest eval/loss."""
    result = cli("-m", "experiment=optuna", "hydra.sweeper.n_trials=3", *TINY,
                 "launch.nproc_per_node=1", "tracking.objective.metric=eval/loss",
                 "tracking.objective.direction=minimize")
    assert result.returncode == 0, result.stderr[-3000:]
    children = sweep_children(tmp_path, 3)
    losses = [r.data.metrics["eval/loss"] for r in children]
    assert len(set(losses)) == 3  # the trials differ, so min and max tell the direction apart
    [found] = (tmp_path / "multirun").glob("*/*/optimization_results.yaml")
    results = yaml.safe_load(found.read_text())
    assert results["best_value"] == pytest.approx(min(losses), rel=1e-9)
    [parent] = [r for r in mlflow_runs(tmp_path) if "mlflow.parentRunId" not in r.data.tags]
    assert parent.data.metrics["best/eval/loss"] == min(losses)


def test_sweeper_direction_other_than_the_objective_is_refused(cli, tmp_path):
    """Optuna's own default direction (minimize) against the default objective (eval/accuracy,
    maximize) would search for the worst run: refused before any job, in one line."""
    result = cli("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", *TINY)
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if line.startswith("mgpu:")]
    assert line == result.stderr.strip().splitlines()[-1]
    assert "hydra.sweeper.direction=minimize" in line
    assert "tracking.objective.direction=maximize (eval/accuracy)" in line
    assert mlflow_runs(tmp_path) == []
