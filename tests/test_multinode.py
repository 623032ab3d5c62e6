"""One job on several nodes: two node agents on loopback, each `python -m mgpu` on its own."""

from __future__ import annotations

import json
import os
import re
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


def start_nodes(
    tmp_path, *overrides: str, per_node: tuple[list[str], ...] = ([], [])
) -> list[tuple[int, str, str]]:
    """`python -m mgpu` node agents of a 2-node job on loopback, started together in `tmp_path`
    with one process each, one per entry of `per_node` (each node's own extra overrides);
    returns each one's (exit code, stdout, stderr)."""
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
        subprocess.Popen([*command, *own], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for own in per_node
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


def test_a_node_alone_times_out_naming_the_endpoint_and_who_arrived(tmp_path):
    """One node of two: the rendezvous gives up after launch.rdzv_timeout_s with one line that
    names the endpoint and how many nodes arrived; no run is created."""
    [(code, _, stderr)] = start_nodes(tmp_path, "launch.rdzv_timeout_s=3", per_node=([],))
    assert code == 1, stderr[-2000:]
    line = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"mgpu: run failed: rendezvous at 127\.0\.0\.1:\d+ timed out after "
        r"launch\.rdzv_timeout_s=3 s: 1 of 2 nodes arrived \(launch\.nnodes=2\); start the "
        r"other nodes with launch\.rdzv_endpoint=127\.0\.0\.1:\d+ and the same overrides, or "
        r"raise launch\.rdzv_timeout_s", line), line
    assert mlflow_runs(tmp_path) == []


def test_nodes_started_with_different_overrides_fail_on_every_node(tmp_path):
    """Each node resolved its own config: where they differ, every node fails with the same
    line naming the keys and both values, before any worker starts or any run exists."""
    nodes = start_nodes(tmp_path, per_node=(["optim.lr=0.001", "seed=1"],
                                            ["optim.lr=0.003", "seed=1"]))
    lines = []
    for code, _, stderr in nodes:
        assert code == 2, stderr[-2000:]
        lines.append(stderr.strip().splitlines()[-1])
    assert lines[0] == lines[1], lines
    assert lines[0].startswith("mgpu: config error: the nodes' configs differ: optim.lr ("), lines
    assert "0.001" in lines[0] and "0.003" in lines[0] and "seed" not in lines[0], lines
    assert mlflow_runs(tmp_path) == []
