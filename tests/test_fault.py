"""Failures end-to-end through the CLI: hangs, ranks that always fail, resumed invocations, a
schedule of several faults in one run."""

from __future__ import annotations

import re
import time
from datetime import datetime

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient

from mgpu.fault import drawn
from mgpu.job import FaultSchedule
from tests.conftest import QUICK, mlflow_runs

pytestmark = pytest.mark.e2e
SHORT = [arg for arg in QUICK if not arg.startswith("train.steps=")]


def leftover_processes(tmp_path) -> list:
    return [
        p for p in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))
    ]


PROGRESS = re.compile(r"^\[rank\d+\] .* INFO mgpu\.trainer: step \d+ ")


def console_after_fault(stderr: str, mode: str) -> list[str]:
    """The console's lines after the injected fault's own log line, less the other ranks'
    progress lines: those are separate processes, and one may still print a step after the
    faulty rank logged its fault."""
    lines = stderr.strip().splitlines()
    [at] = [i for i, line in enumerate(lines) if f"injecting fault.mode={mode}" in line]
    return [line for line in lines[at + 1:] if not PROGRESS.match(line)]


def test_hung_rank_fails_the_run_within_the_timeout_naming_rank_and_step(cli, tmp_path):
    timeout_s = 5
    result = cli(*QUICK, "fault.mode=hang", "fault.kill_rank=1", "fault.at_step=5",
                 f"launch.timeout_s={timeout_s}")
    ended = time.time()
    assert result.returncode == 1
    [out] = tmp_path.glob("outputs/*/*")
    # One line after the progress output; torch elastic's tracebacks stay in the logs.
    assert console_after_fault(result.stderr, "hang") == [
        f"mgpu: run failed: rank 1 hung at step 5: its peers timed out after "
        f"launch.timeout_s={timeout_s} s waiting for it (logs: {out}/logs)"
    ], result.stderr[-3000:]
    assert "Timed out" in (out / "logs" / "elastic" / "agent.log").read_text()
    [log] = tmp_path.glob("outputs/*/*/logs/rank1.log")
    [hang] = [line for line in log.read_text().splitlines() if "injecting fault.mode=hang" in line]
    hung_at = datetime.strptime(hang.split(" ", 1)[1][:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    # Margin: the group's teardown and the interpreter's exit, slow on a busy 2-core machine;
    # without the timeout reaching the process group, peers would wait 300 s (the default).
    assert ended - hung_at < timeout_s + 60
    assert not leftover_processes(tmp_path)
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED" and "rank 1 hung" in run.data.tags["mgpu.error"]


def test_killed_rank_ends_the_run_with_one_line_naming_rank_and_step(cli, tmp_path):
    result = cli(*QUICK, "fault.mode=sigkill", "fault.kill_rank=1", "fault.at_step=5",
                 "train.log_every=1")
    assert result.returncode == 1
    [out] = tmp_path.glob("outputs/*/*")
    assert console_after_fault(result.stderr, "sigkill") == [
        f"mgpu: run failed: rank 1 was killed by SIGKILL at step 5 (logs: {out}/logs)"
    ], result.stderr[-3000:]
    assert "SIGKILL" in (out / "logs" / "elastic" / "agent.log").read_text()
    assert not leftover_processes(tmp_path)
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED" and "rank 1 was killed" in run.data.tags["mgpu.error"]
    # Rank 0's points still queued when the group failed are written on its way out.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == [1, 2, 3, 4]


def test_rank_that_always_fails_is_restarted_exactly_max_restarts_times(cli, tmp_path):
    result = cli(*QUICK, "fault.mode=exception", "fault.kill_rank=1", "fault.at_step=2",
                 "fault.every_attempt=true", "launch.max_restarts=2")
    assert result.returncode == 1
    assert "rank 1 failed" in result.stderr and "injected fault" in result.stderr
    attempts = {p.name for p in tmp_path.glob("outputs/*/*/logs/elastic/*/attempt_*")}
    assert attempts == {"attempt_0", "attempt_1", "attempt_2"}
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
    assert "rank 1 failed" in run.data.tags["mgpu.error"]
    assert "injected fault" in run.data.tags["mgpu.error"]
    assert not leftover_processes(tmp_path)


def test_later_invocation_resumes_and_continues_the_same_mlflow_run(cli, tmp_path):
    same_dir = [f"hydra.run.dir={tmp_path / 'run'}", "checkpoint.every_steps=10"]
    first = cli(*SHORT, "train.steps=20", *same_dir)
    assert first.returncode == 0, first.stderr
    second = cli(*SHORT, "train.steps=30", *same_dir)
    assert second.returncode == 0, second.stderr
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["checkpoint/resumed_from_step"] == 20
    assert run.data.params["train.steps"] == "20"  # params stay as the run first logged them
    assert run.info.run_id in second.stdout


def injected(output_dir) -> list[tuple[str, int, int]]:
    """(mode, rank, step) of every fault the run's ranks logged injecting, over all attempts."""
    found = []
    for log in output_dir.glob("logs/rank*.log"):
        for mode, rank, step in INJECTED.findall(log.read_text()):
            found.append((mode, int(rank), int(step)))
    return sorted(found, key=lambda fired: fired[2])


INJECTED = re.compile(r"injecting fault\.mode=(\w+) on rank (\d+) at step (\d+)")


def test_a_schedule_of_mixed_faults_fires_each_once_and_ends_bitwise_equal(cli, tmp_path):
    """Three faults over one run, one per attempt: a rank killed while it writes a checkpoint,
    a hang caught by the collective timeout and a SIGKILL. Each fires once, on its drawn rank
    and step; the group restarts three times, resumes from its newest checkpoint each time and
    ends FINISHED with the weights of the run that never failed, bitwise."""
    every, steps = 5, 30
    schedule = FaultSchedule(count=3, seed=1, kinds=["checkpoint_sigkill", "hang", "sigkill"])
    common = [*QUICK, f"checkpoint.every_steps={every}"]
    clean = cli(*common, f"hydra.run.dir={tmp_path / 'clean'}")
    assert clean.returncode == 0, clean.stderr[-3000:]
    chaos = cli(*common, f"fault.schedule.count={schedule.count}",
                f"fault.schedule.seed={schedule.seed}",
                f"fault.schedule.kinds=[{','.join(schedule.kinds)}]",
                f"launch.max_restarts={schedule.count}", "launch.timeout_s=5",
                f"hydra.run.dir={tmp_path / 'chaos'}")
    assert chaos.returncode == 0, chaos.stderr[-3000:]
    planned = drawn(schedule, steps, every, world_size=2)
    assert sorted(fault.mode for fault in planned) == sorted(schedule.kinds)
    assert injected(tmp_path / "chaos") == [(f.mode, f.rank, f.step) for f in planned]
    attempts = {p.name for p in tmp_path.glob("chaos/logs/elastic/*/attempt_*")}
    assert attempts == {"attempt_0", "attempt_1", "attempt_2", "attempt_3"}
    resumed = re.findall(r"resumed from \S+ \(step (\d+),", (tmp_path / "chaos" / "logs" /
                                                            "rank0.log").read_text())
    # Drawn: a hang at step 9 (resumed from 5), a kill while writing checkpoint 10 (which is
    # never committed: resumed from 5 again), a SIGKILL at 18 (resumed from 15).
    assert resumed == ["5", "5", "15"]
    assert [run.info.status for run in mlflow_runs(tmp_path)] == ["FINISHED", "FINISHED"]
    weights = torch.load(tmp_path / "chaos" / "model.pt", weights_only=True)
    clean_weights = torch.load(tmp_path / "clean" / "model.pt", weights_only=True)
    assert weights.keys() == clean_weights.keys()
    for name in clean_weights:
        assert torch.equal(weights[name], clean_weights[name]), name
    assert not leftover_processes(tmp_path)
