"""End-to-end: the real CLI in a temporary directory, with a real SQLite MLflow store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import QUICK, mlflow_runs

pytestmark = pytest.mark.e2e


def test_default_run_is_recorded_in_mlflow(cli, tmp_path):
    result = cli("train.steps=150", "eval.every_steps=50")
    assert result.returncode == 0, result.stderr
    assert "eval/accuracy" in result.stdout and "make ui" in result.stdout
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    for key in ("train/loss", "train/samples_per_s", "time/step_p50_s", "time/step_p90_s",
                "time/step_p99_s", "eval/accuracy", "eval/loss", "memory/peak_bytes"):
        assert key in metrics, key
    assert metrics["eval/accuracy"] >= 0.9
    assert run.data.params["data.batch_size"] == "64"
    assert run.data.params["launch.world_size"] == "2"
    assert run.data.tags["strategy"] == "ddp" and run.data.tags["model"] == "mlp"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "overrides.yaml"} <= artifacts
    history = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert [m.step for m in history] == [50, 100, 150]
    # The planner's prediction for the run's own layout from step 0, its errors at the end:
    # DDP holds whole parameters and AdamW's two states, exactly as predicted.
    predicted = client.get_metric_history(run.info.run_id, "plan/predicted_step_seconds")
    assert predicted[0].step == 0 and predicted[0].value > 0
    assert metrics["plan/error_state_bytes"] == pytest.approx(0, abs=1e-3)
    assert "plan/error_step_time" in metrics
    out_dir = run.data.tags["mgpu.output_dir"]
    assert f"  outputs: {out_dir} (model.pt, summary.json, logs/)" in result.stdout.splitlines()
    summary = json.loads(open(os.path.join(out_dir, "summary.json")).read())
    assert summary["run_id"] == run.info.run_id
    assert os.path.exists(os.path.join(out_dir, "logs", "rank1.log"))


def test_multirun_makes_one_parent_and_a_child_per_job(cli, tmp_path):
    result = cli("-m", *QUICK, "strategy=single,ddp", "optim.lr=1e-3,3e-3")
    assert result.returncode == 0, result.stderr
    runs = mlflow_runs(tmp_path)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 4
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    combos = {(r.data.tags["strategy"], r.data.params["optim.lr"]) for r in children}
    assert combos == {("single", "0.001"), ("single", "0.003"), ("ddp", "0.001"), ("ddp", "0.003")}
    assert len({r.data.tags["mgpu.output_dir"] for r in children}) == 4


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["strategy.bucket_cap=3"], "strategy.bucket_cap"),
        (["+strategy.bucket_cap=3"], "strategy.bucket_cap"),
        (["optim.lr=fast"], "optim.lr"),
        (["strategy=dpp"], "strategy"),
        (["train.steps=many"], "train.steps"),
        (["strategy=single", "launch.nproc_per_node=2"], "launch.nproc_per_node"),
        (["tracking.uri=http://127.0.0.1:9"], "tracking.uri"),  # no MLflow server there
    ],
)
def test_bad_input_exits_with_one_line_and_no_run(cli, tmp_path, args, key):
    result = cli(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert key in lines[0] and lines[0].startswith("mgpu: config error:")
    assert not [r for r in mlflow_runs(tmp_path) if r.info.status == "RUNNING"]
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("*.pt"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["strategy.bucket_cap=3"], "strategy.bucket_cap: Key 'bucket_cap' is not in struct"),
        (["strategy=tp", "model=cnn"], "strategy=tp cannot run with model=cnn"),
    ],
)
def test_hydra_full_error_shows_the_traceback_and_keeps_exit_code_2(tmp_path, args, message):
    """`HYDRA_FULL_ERROR=1` asks for the traceback of a user mistake; it stays a config error."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "HYDRA_FULL_ERROR": "1"}
    result = subprocess.run([sys.executable, "-m", "mgpu", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mgpu: config error: {message}"), result.stderr


def test_failing_worker_fails_the_run_and_leaves_no_process(cli, tmp_path):
    result = cli(*QUICK, "fault.mode=exception", "fault.kill_rank=1", "fault.at_step=5")
    assert result.returncode == 1
    assert "rank 1 failed" in result.stderr and "injected fault" in result.stderr
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
    assert "injected fault" in run.data.tags["mgpu.error"]
    leftovers = [
        p for p in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))
    ]
    assert not leftovers


def test_torchrun_makes_one_run_in_one_output_dir(tmp_path):
    """Every rank composes the config itself: all must still write into one output dir (its
    logs, checkpoints, `.hydra/`), and rank 0 writes the summary and prints the closing lines,
    as `python -m mgpu` does."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "mgpu",
         "train.steps=20", "eval.every_steps=0", "checkpoint.every_steps=10", "strategy=ddp"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    assert run.data.params["launch.world_size"] == "2"
    assert "eval/accuracy" in run.data.metrics
    [out] = (tmp_path / "outputs").glob("*/*")
    assert str(out) == run.data.tags["mgpu.output_dir"]
    assert {p.name for p in (out / "logs").glob("rank*.log")} == {"rank0.log", "rank1.log"}
    assert {"__0_0.distcp", "__1_0.distcp"} <= {
        p.name for p in (out / "checkpoints" / "step_00000020").iterdir()}
    assert (out / ".hydra" / "config.yaml").is_file() and (out / "model.pt").is_file()
    assert json.loads((out / "summary.json").read_text())["run_id"] == run.info.run_id
    assert result.stdout.count("mgpu: done.") == 1
    assert f"outputs: {out}" in result.stdout and run.info.run_id in result.stdout
