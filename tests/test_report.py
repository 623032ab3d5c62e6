"""`python -m mgpu.report` on a real 2x2 sweep run through the CLI into a temporary store, and
its calibration plot on runs created in a real MLflow SQLite store."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from mgpu.model.mlp import MLP
from mgpu.report import (
    CONTENDED_ABOVE,
    PARENT_TAG,
    STATE_BYTES,
    STEP_TIME,
    SWEEP_TAG,
    calibration_points,
    report,
    sweep_children,
)
from tests.conftest import QUICK, mlflow_runs

pytestmark = pytest.mark.e2e


def test_report_turns_a_2x2_sweep_into_a_table_and_plots(cli, tmp_path):
    result = cli("-m", *QUICK, "monitor.enabled=true", "strategy=single,ddp",
                 "optim.lr=1e-3,3e-3")
    assert result.returncode == 0, result.stderr
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    report = subprocess.run(
        [sys.executable, "-m", "mgpu.report", "--experiment", "mgpu", "--out", "rep"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert report.returncode == 0, report.stderr

    with open(tmp_path / "rep" / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert {(r["strategy"], r["optim.lr"]) for r in rows} == {
        ("single", "0.001"), ("single", "0.003"), ("ddp", "0.001"), ("ddp", "0.003")}
    assert all(float(r["eval/accuracy"]) > 0 and float(r["train/samples_per_s"]) > 0
               for r in rows)
    # Comm bytes only where there is communication: the DDP jobs, one fp32 gradient each.
    grad_bytes = sum(p.numel() * 4 for p in MLP((1, 8, 8), 10).parameters())
    assert {r["comm/bytes_per_step"] for r in rows if r["strategy"] == "ddp"} == {
        str(float(grad_bytes))}
    assert {r["comm/bytes_per_step"] for r in rows if r["strategy"] == "single"} == {""}
    for row in rows:  # each run measured the machine's other load and is marked by it
        other = float(row["host/other_cpu_fraction"])
        assert 0 <= other <= 1
        assert row["timing"] == ("contended" if other > CONTENDED_ABOVE else "quiet")
    markdown = (tmp_path / "rep" / "report.md").read_text()
    assert markdown.count("| FINISHED |") == 4
    assert markdown.startswith("# Sweep train.steps=30 ")  # the parent run's name, once
    png = tmp_path / "rep" / "throughput_vs_accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "rep" / "scaling.png").exists()  # world size 1 and 2 in this sweep

    [parent] = [r for r in mlflow_runs(tmp_path) if "mlflow.parentRunId" not in r.data.tags]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/report.csv",
            "report/throughput_vs_accuracy.png", "report/scaling.png"} <= logged


def test_the_calibration_plot_puts_each_run_at_its_predicted_and_measured_figures(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("mgpu")
    parent = client.create_run(experiment, run_name="sweep strategy=ddp,fsdp,single",
                               tags={SWEEP_TAG: str(tmp_path)}).info.run_id
    # (predicted step s, measured step s, param bytes, optimizer bytes, state bytes error)
    logged = {"ddp": (0.010, 0.020, 1000.0, 2000.0, 0.05), "fsdp": (0.030, 0.025, 500.0, 1000.0,
                                                                  -0.10)}
    for strategy in ("ddp", "fsdp", "single"):  # single: a run without the planner's figures
        run = client.create_run(experiment, run_name=strategy,
                                tags={PARENT_TAG: parent, "strategy": strategy}).info.run_id
        figures = {"time/step_p50_s": 0.02, "memory/param_bytes_per_rank": 100.0}
        if strategy in logged:
            predicted_s, measured_s, params, optimizer, state_error = logged[strategy]
            figures = {"plan/predicted_step_seconds": predicted_s, "time/step_p50_s": measured_s,
                       "plan/error_step_time": predicted_s / measured_s - 1,
                       "memory/param_bytes_per_rank": params,
                       "memory/optimizer_bytes_per_rank": optimizer,
                       "plan/error_state_bytes": state_error}
        for key, value in figures.items():
            client.log_metric(run, key, value)
        client.set_terminated(run)

    out = report(uri, None, parent, tmp_path / "rep")
    assert (out / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = {r.data.tags["strategy"]: calibration_points(r)
              for r in sweep_children(client, client.get_run(parent))}
    assert points["ddp"][STEP_TIME] == (0.010, 0.020)
    assert points["ddp"][STATE_BYTES] == pytest.approx((1.05 * 3000, 3000))
    assert points["fsdp"][STATE_BYTES] == pytest.approx((0.9 * 1500, 1500))
    assert points["single"] == {}
    with open(out / "report.csv") as f:
        rows = {r["strategy"]: r for r in csv.DictReader(f)}
    assert float(rows["fsdp"]["plan/error_step_time"]) == pytest.approx(0.2)
    assert rows["single"]["plan/error_step_time"] == ""
    logged_files = {a.path for a in client.list_artifacts(parent, "report")}
    assert "report/calibration.png" in logged_files
