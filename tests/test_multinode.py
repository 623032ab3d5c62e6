"""One job on several nodes: two node agents on loopback, each `python -m mgpu` on its own."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import launch_job, mlflow_runs

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


# An elastic job of 1 to 2 single-process nodes that notices a node gone within 3 s and forms a
# group of the nodes there 2 s after the first; SGD (exact comparisons), a checkpoint every 5
# steps. Each rank sleeps a random 0.2 s per step (exponential, seeded) so that a node's start
# takes tens of steps, not all of them: the sleep changes no number.
ELASTIC_JOB = ["optim=sgd", "train.steps=120", "train.log_every=10", "eval.every_steps=0",
               "checkpoint.every_steps=5"]
ELASTIC_NODE = ["launch.nnodes=1:2", "launch.nproc_per_node=1", "launch.max_restarts=3",
                "launch.rdzv_last_call_s=2", "launch.rdzv_heartbeat_s=1", "launch.timeout_s=60",
                "straggler.jitter_s=0.2"]


def start_node(tmp_path: Path, port: int, name: str) -> subprocess.Popen:
    """One node agent of the elastic job, in a session of its own: killing the session ends
    the agent and its workers at once, as a machine going down would."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # the store exists before any node opens it
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, "-m", "mgpu", f"launch.rdzv_endpoint=127.0.0.1:{port}",
               *ELASTIC_NODE, *ELASTIC_JOB]
    with (tmp_path / f"{name}.out").open("w") as out:
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(condition, what: str, nodes: dict[str, subprocess.Popen], timeout_s: float = 240):
    """Poll `condition` until it returns something true; fail naming `what` if it never does
    or a node exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        exited = [name for name, node in nodes.items() if node.poll() is not None]
        assert not exited, f"node {exited} exited while waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def checkpoint_at(out: Path, world_size: int, after: int = 0) -> int | None:
    """The step of a committed checkpoint later than `after` saved at `world_size`, if any."""
    for manifest in sorted(out.glob("checkpoints/step_*/mgpu.json")):
        saved = json.loads(manifest.read_text())
        if saved["world_size"] == world_size and saved["step"] > after:
            return saved["step"]
    return None


def metric_history(tmp_path: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of each point of a run's metric, in step order."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_a_node_leaves_and_another_joins_in_one_run(tmp_path):
    """Two nodes train; one dies with its workers (SIGKILL of its session); the other goes on
    alone from the last checkpoint, resharded; a new node joins and the group is back at 2.
    One MLflow run holds it all with each change's world size, restart count and time lost,
    and the final weights are those of a run that never changed size, within float rounding
    (the global batch and its sample order are the same at any world size; a world of 1 sums
    the batch's gradient in another order than 2 ranks averaging their halves)."""
    port = free_port()
    nodes = {"first": start_node(tmp_path, port, "first")}
    # The first node hosts the rendezvous store (it composed first), so the second may die.
    out = wait_for(lambda: next((tmp_path / "outputs").glob("*/*"), None), "an output dir",
                   nodes)
    nodes["second"] = start_node(tmp_path, port, "second")
    at_two = wait_for(lambda: checkpoint_at(out, 2), "a checkpoint at world size 2", nodes)
    second = nodes.pop("second")
    os.killpg(second.pid, signal.SIGKILL)
    second.wait()
    wait_for(lambda: checkpoint_at(out, 1, after=at_two), "a checkpoint at world size 1", nodes)
    nodes["third"] = start_node(tmp_path, port, "third")
    for name, node in nodes.items():
        assert node.wait(timeout=300) == 0, (tmp_path / f"{name}.out").read_text()[-3000:]

    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    assert "mgpu.error" not in run.data.tags
    assert run.data.params["launch.world_size"] == "1:2"
    sizes = metric_history(tmp_path, run.info.run_id, "elastic/world_size")
    restarts = metric_history(tmp_path, run.info.run_id, "elastic/restarts")
    lost = metric_history(tmp_path, run.info.run_id, "elastic/seconds_lost")
    # The first node may have started alone and grown to 2 when the second came.
    assert [size for _, size in sizes][-3:] == [2, 1, 2], sizes
    assert [count for _, count in restarts] == list(range(len(sizes))), restarts
    assert [step for step, _ in lost] == [step for step, _ in sizes[1:]], (lost, sizes)
    assert all(seconds > 0 for _, seconds in lost), lost
    assert json.loads((out / "summary.json").read_text())["step"] == 120

    reference, weights = launch_job([*ELASTIC_JOB, "launch.nproc_per_node=2"],
                                    tmp_path / "reference")
    final = torch.load(out / "model.pt", weights_only=True)
    for name, tensor in weights.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval/loss"] == pytest.approx(reference["eval/loss"], abs=1e-6)


def test_each_node_samples_its_own_system_metrics_under_its_node_id(tmp_path):
    """With `tracking.system_metrics`, every node's local rank 0 samples its machine into the
    run, the keys naming the node (`system/node1/...`); one node's figures never stand for the
    job's."""
    nodes = start_nodes(tmp_path, "tracking.system_metrics=true", "monitor.interval_s=0.5",
                        "train.steps=60", "straggler.jitter_s=0.05")  # a few seconds
    for code, _, stderr in nodes:
        assert code == 0, stderr[-3000:]
    [run] = mlflow_runs(tmp_path)
    system = {key for key in run.data.metrics if key.startswith("system/")}
    for node in ("node0", "node1"):
        assert f"system/{node}/cpu_utilization_percentage" in system, sorted(system)
    assert not [key for key in system if not key.startswith(("system/node0/", "system/node1/"))]
