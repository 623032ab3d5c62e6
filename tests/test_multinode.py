"""One job on several nodes: two node agents on loopback, each `python -m mgpu` on its own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import mlflow_runs

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(tmp_path, *overrides: str) -> list[tuple[int, str, str]]:
    """Two `python -m mgpu` node agents on loopback, started together in `tmp_path` with one
    process each; returns each one's (exit code, stdout, stderr)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # Created once, before both nodes start: two processes creating a new SQLite store race in
    # its schema migration.
    MlflowClient(uri).search_experiments()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [
        sys.executable, "-m", "mgpu", "launch.nnodes=2", "launch.nproc_per_node=1",
        f"launch.rdzv_endpoint=127.0.0.1:{free_port()}", "launch.timeout_s=120",
        "train.steps=20", "eval.every_steps=0", *overrides,
    ]
    nodes = [
        subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    return [(node.returncode, *output) for node, output in zip(nodes, outputs, strict=True)]


def test_two_nodes_make_one_run_one_output_dir_and_complete_checkpoints(tmp_path):
    """Whichever node holds global rank 0 owns the run: one MLflow run, one output dir whose
    checkpoint holds both ranks' shards, and the summary; the other node says where it is."""
    nodes = start_nodes(tmp_path, "checkpoint.every_steps=10")
    for code, _, stderr in nodes:
        assert code == 0, stderr[-3000:]
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    assert "eval/accuracy" in run.data.metrics
    [out] = (tmp_path / "outputs").glob("*/*")
    assert str(out) == run.data.tags["mgpu.output_dir"]
    checkpoint = out / "checkpoints" / "step_00000020"
    assert {"__0_0.distcp", "__1_0.distcp", "mgpu.json"} <= {p.name for p in checkpoint.iterdir()}
    assert {p.name for p in (out / "logs").glob("rank*.log")} == {"rank0.log", "rank1.log"}
    assert json.loads((out / "summary.json").read_text())["run_id"] == run.info.run_id
    stdouts = sorted((stdout for _, stdout, _ in nodes), key=lambda s: "mgpu: done." in s)
    other, owner = stdouts
    assert owner.count("mgpu: done.") == 1 and f"outputs: {out}" in owner
    assert "holds rank 0" in other and run.info.run_id in other and str(out) in other


def test_rank_0_killed_leaves_no_running_run(tmp_path):
    """Rank 0 owns the run but dies by SIGKILL, unable to close it: a parent closes it."""
    nodes = start_nodes(tmp_path, "fault.mode=sigkill", "fault.kill_rank=0", "fault.at_step=5")
    assert [code for code, _, _ in nodes] == [1, 1], [stderr[-2000:] for _, _, stderr in nodes]
    assert any("rank 0" in stderr for _, _, stderr in nodes)
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
