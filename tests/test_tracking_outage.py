"""A tracking store that goes away: a real `mlflow server` on 127.0.0.1, stopped and restarted.

What the run logs while the server is down is spooled in its output dir and written once the
server is back; nothing is lost and the run keeps its order and its final status.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mgpu import tracking

pytestmark = pytest.mark.e2e

WAIT_S = 120  # a bound for what the tests wait on, not a timing assertion


class MlflowServer:
    """`mlflow server` with a SQLite backend in `root`, on one port across restarts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            cwd=self.root, env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(self.healthy, "the MLflow server to answer")

    def healthy(self) -> bool:
        assert self.process.poll() is None, "the MLflow server exited"
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server and every process it started (its session) at once: one that shuts
        down gracefully answers some requests for a while (seconds, on a loaded machine) and
        refuses others, which is several outages, not one."""
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A running server; the client gives up after a few seconds, as mgpu sets it."""
    for name, value in tracking.HTTP_RETRY_ENV.items():
        monkeypatch.setenv(name, value)
    root = tmp_path / "server"
    root.mkdir()
    server = MlflowServer(root)
    server.start()
    yield server
    server.stop()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {WAIT_S} s for {what}")
        time.sleep(0.2)


def spooled(output_dir: Path) -> list[dict]:
    return tracking.Spool(output_dir).records()


def steps_of(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


def test_points_logged_while_the_server_is_down_reach_the_run_in_order(
    server, tmp_path, caplog
):
    client = MlflowClient(server.uri)
    run_id = client.create_run(client.create_experiment("outage")).info.run_id
    out = tmp_path / "out"
    caplog.set_level(logging.INFO, logger="mgpu.tracking")
    logger = tracking.MetricLogger(server.uri, run_id, out, flush_every_s=0.2)

    logger.log({"train/loss": 1.0}, 1)
    wait_for(lambda: steps_of(client, run_id, "train/loss") == [1], "the first point")
    server.stop()
    for step in range(2, 12):  # two flushes (at least) that fail
        logger.log({"train/loss": 1.0 / step}, step)
        if step in (6, 11):
            wait_for(lambda s=step: sum(len(r["metrics"]) for r in spooled(out)) == s - 1,
                     f"points up to step {step} in the spool")
    kept = len(spooled(out))
    server.start()
    wait_for(lambda: not tracking.Spool(out).pending(), "the logger to write its spool")
    logger.log({"train/loss": 0.01}, 12)
    logger.close()

    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 13))
    assert [m.value for m in history] == [1.0 / step for step in range(1, 12)] + [0.01]
    ours = [r for r in caplog.records if r.name == "mgpu.tracking"]
    warnings = [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0], warnings
    assert [r.getMessage() for r in ours if r.levelno == logging.INFO] == [
        f"MLflow is back: wrote the {kept} records kept in {out / tracking.SPOOL_FILE}"]


def test_a_run_whose_server_goes_away_exits_0_and_sync_writes_all_it_kept(server, tmp_path):
    """The server stops after the run's first points and stays down past its end: the run
    finishes, and `python -m mgpu.tracking sync` after a restart leaves it FINISHED with
    every point a run without an outage has."""
    out = tmp_path / "out"
    steps, log_every, eval_every = 300, 10, 150
    env = {**os.environ, "MGPU_CACHE_DIR": str(tmp_path / ".cache")}
    env.pop("HYDRA_FULL_ERROR", None)
    run = subprocess.Popen(
        [sys.executable, "-m", "mgpu", f"tracking.uri={server.uri}", f"hydra.run.dir={out}",
         f"train.steps={steps}", f"train.log_every={log_every}",
         f"eval.every_steps={eval_every}", "checkpoint.every_steps=0",
         "straggler.jitter_s=0.02"],  # ~10 s of training, most of it with the server down
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        client = MlflowClient(server.uri)

        def first_points() -> bool:
            assert run.poll() is None, run.communicate()
            found = client.search_runs([e.experiment_id for e in client.search_experiments()])
            return bool(found) and "train/loss" in found[0].data.metrics

        wait_for(first_points, "the run's first points")
        server.stop()
        stdout, stderr = run.communicate(timeout=WAIT_S)
    finally:
        run.kill()
    assert run.returncode == 0, stderr
    assert f"python -m mgpu.tracking sync {out}" in stdout
    kept = spooled(out)
    assert kept[-1]["status"] == "FINISHED"
    log_text = (out / "logs" / "rank0.log").read_text()
    assert log_text.count("is unreachable") == 1, log_text
    assert "Retrying" not in log_text  # urllib3's line per retry

    server.start()
    sync = subprocess.run([sys.executable, "-m", "mgpu.tracking", "sync", str(out)],
                          env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert sync.returncode == 0, sync.stderr
    assert f"wrote {len(kept)} records" in sync.stdout
    assert not tracking.Spool(out).pending()
    run_id = json.loads((out / "summary.json").read_text())["run_id"]
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    train_steps = list(range(log_every, steps + 1, log_every))
    assert steps_of(client, run_id, "train/loss") == train_steps
    assert steps_of(client, run_id, "eval/accuracy") == list(range(eval_every, steps + 1,
                                                                   eval_every))
    assert "plan/error_step_time" in finished.data.metrics  # the parent's, after the run


def test_a_store_made_anew_without_the_run_keeps_its_points_for_sync(tmp_path, caplog):
    """A removed SQLite file is made anew, empty, by the next process that opens the store (the
    next job, `make ui`): it answers, but no longer holds the run. The run's points are kept,
    not dropped, and `sync` writes them once the file is restored."""
    saved = tmp_path / "saved.db"
    client = MlflowClient(f"sqlite:///{saved}")
    run_id = client.create_run(client.create_experiment("removed")).info.run_id
    client.log_metric(run_id, "train/loss", 1.0, step=1)
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    MlflowClient(uri).search_experiments()  # the file made anew
    out = tmp_path / "out"
    caplog.set_level(logging.INFO, logger="mgpu.tracking")
    logger = tracking.MetricLogger(uri, run_id, out, flush_every_s=0.2)
    for step in range(2, 6):
        logger.log({"train/loss": 1.0 / step}, step)
    logger.close()
    assert sum(len(r["metrics"]) for r in spooled(out)) == 4
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "mgpu.tracking" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not found" in warnings[0], warnings

    saved.replace(db)  # restored
    sync = subprocess.run([sys.executable, "-m", "mgpu.tracking", "sync", str(out)],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert sync.returncode == 0, sync.stderr
    with sqlite3.connect(db) as store:  # this process's MLflow holds the made-anew file open
        steps = store.execute("SELECT step FROM metrics WHERE run_uuid = ? AND key = ? "
                              "ORDER BY step", (run_id, "train/loss")).fetchall()
    assert [step for (step,) in steps] == [1, 2, 3, 4, 5]
