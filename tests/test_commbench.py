"""task=commbench: the nccl-tests formulas, its checks, and a real run on 2 gloo processes."""

from __future__ import annotations

import csv
import json
import os

import pytest
from mlflow.tracking import MlflowClient

from mgpu.task.commbench import OPS, bus_factor, message_sizes, result
from tests.conftest import assert_refused, mlflow_runs


@pytest.mark.parametrize(
    ("op", "world_size", "busbw"),
    [
        ("all_reduce", 2, 2.0),  # 2(n-1)/n x algbw, algbw = 2 GB / 1 s
        ("all_reduce", 4, 3.0),
        ("all_reduce", 8, 3.5),
        ("all_gather", 4, 1.5),  # (n-1)/n
        ("reduce_scatter", 8, 1.75),
        ("broadcast", 8, 2.0),  # 1
    ],
)
def test_bus_bandwidth_follows_nccl_tests(op, world_size, busbw):
    res = result(op, size_bytes=2_000_000_000, seconds=1.0, world_size=world_size)
    assert res.algbw_GBps == pytest.approx(2.0)
    assert res.busbw_GBps == pytest.approx(busbw)
    assert result(op, 1_000_000, 0.5e-3, world_size).algbw_GBps == pytest.approx(2.0)


def test_message_sizes_double_and_split_evenly_over_ranks():
    assert message_sizes(1024, 65536, 2, 2) == [1024 * 2**i for i in range(7)]
    assert message_sizes(1024, 4096, 4, 2) == [1024, 4096]
    assert message_sizes(1000, 1000, 2, 3) == [996]  # whole float32 elements per rank
    assert message_sizes(1, 8, 2, 2) == [8]  # at least one element per rank, no repeats


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task.min_bytes=0"], "task.min_bytes=0: must be > 0"),
        (["task.min_bytes=-8"], "task.min_bytes=-8: must be > 0"),
        (["task.min_bytes=4096", "task.max_bytes=1024"],
         "task.min_bytes=4096: must be <= task.max_bytes=1024"),
        (["task.ops=[all_to_all]"], "task.ops=['all_to_all']: choose from all_reduce"),
        (["task.ops=[]"], "task.ops=[]"),
        (["task.factor=1"], "task.factor=1: must be >= 2"),
        (["task.repeats=0"], "task.repeats=0"),
    ],
)
def test_bad_commbench_input_is_one_config_error(overrides, message, tmp_path):
    assert_refused(["task=commbench", *overrides], message, tmp_path)


@pytest.mark.e2e
def test_commbench_on_two_gloo_processes_logs_bandwidth_against_size(cli, tmp_path):
    result_ = cli("task=commbench", "network=ethernet", "task.max_bytes=65536", "task.repeats=5")
    assert result_.returncode == 0, result_.stderr
    assert "commbench peak busbw (GB/s): all_reduce" in result_.stdout
    [run] = mlflow_runs(tmp_path)
    # The closing lines list what this task wrote, and only that.
    out = run.data.tags["mgpu.output_dir"]
    assert f"  outputs: {out} (commbench.csv, summary.json, logs/)" in result_.stdout.splitlines()
    assert not os.path.exists(os.path.join(out, "model.pt"))
    assert run.info.status == "FINISHED" and run.data.tags["task"] == "commbench"
    # env. params: exactly the variables network=ethernet sets, nothing else from the environment
    env = {k: v for k, v in run.data.params.items() if k.startswith("env.")}
    assert env == {"env.NCCL_IB_DISABLE": "1", "env.NCCL_SOCKET_IFNAME": "^lo,docker",
                   "env.NCCL_SOCKET_NTHREADS": "4", "env.NCCL_NSOCKS_PERTHREAD": "4"}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    sizes = [1024 * 2**i for i in range(7)]
    for op in OPS:
        for name in ("busbw_GBps", "algbw_GBps", "latency_s"):
            history = client.get_metric_history(run.info.run_id, f"commbench/{op}/{name}")
            assert [m.step for m in history] == sizes, (op, name)
            assert all(m.value > 0 for m in history)
        assert run.data.metrics[f"commbench/{op}/busbw_peak_GBps"] > 0
    assert "commbench.csv" in {a.path for a in client.list_artifacts(run.info.run_id)}
    table = os.path.join(run.data.tags["mgpu.output_dir"], "commbench.csv")
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert [(r["op"], int(r["size_bytes"])) for r in rows] == [(o, s) for o in OPS for s in sizes]
    for row in rows:
        ratio = float(row["busbw_GBps"]) / float(row["algbw_GBps"])
        assert ratio == pytest.approx(bus_factor(row["op"], 2))
    # The planner's table of this machine: each op's lowest latency and peak bus bandwidth.
    [cached] = (tmp_path / ".cache").glob("commbench-*-cpu.json")
    links = json.loads(cached.read_text())
    for op in OPS:
        assert links[op]["busbw_Bps"] == pytest.approx(
            run.data.metrics[f"commbench/{op}/busbw_peak_GBps"] * 1e9)
        assert links[op]["latency_s"] == pytest.approx(
            run.data.metrics[f"commbench/{op}/latency_min_s"])
