"""Shared helpers: compose configs as the CLI does, launch real gloo worker groups, run the CLI.

The suite has three tiers, by marker: unit tests (no marker: no process group, no subprocess
of the CLI; `make test-fast`), `dist` (real gloo process groups) and `e2e` (the CLI in a
subprocess). `make test` runs all three.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mgpu.config import prepare
from mgpu.errors import ConfigError
from mgpu.job import Job
from mgpu.launch import WORKER_ENV, environment, launch
from mgpu.runtime import init_runtime, shutdown
from mgpu.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# Small and quick: enough steps for parity and accuracy checks, no eval in between.
QUICK = ["train.steps=30", "train.warmup_steps=5", "train.log_every=10", "eval.every_steps=0"]


def compose_config(overrides: list[str], hydra: bool = False):
    """The config the CLI composes; with `hydra`, also its `hydra` node (sweeper, choices)."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


def make_job(overrides: list[str], output_dir: Path) -> Job:
    """The resolved job the parent would hand to workers (tracking off)."""
    cfg = compose_config([*overrides, f"output_dir={output_dir}", "tracking.enabled=false"])
    job, _ = prepare(cfg, cuda_devices=0, torchrun_world=None)
    return job


def assert_refused(overrides: list[str], message: str, output_dir: Path) -> str:
    """Composing `overrides` fails in the parent, before any launch, with one ConfigError whose
    message is a single line containing `message` (the key, the value, what would be valid).
    Returns that line, for a test that checks all of it."""
    with pytest.raises(ConfigError) as error:
        make_job(overrides, output_dir)
    line = str(error.value)
    assert message in line, line
    assert "\n" not in line, line
    return line


def launch_job(overrides: list[str], output_dir: Path) -> tuple[dict, dict]:
    """Launch a real worker group; returns (rank 0's summary, the final full model weights)."""
    job = make_job(overrides, output_dir)
    results = launch(job, run_id=None, env={})
    weights = torch.load(output_dir / "model.pt", weights_only=True)
    return results[0], weights


def launch_ranks(function, ranks: int, run_id: str, *args) -> dict:
    """`function(*args)` on each of `ranks` spawned gloo workers, with the environment mgpu's
    launcher gives its workers; returns each rank's result by rank."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=run_id,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          start_method="spawn")
    with environment(WORKER_ENV):
        return elastic_launch(config, function)(*args)


def train_on_this_rank(job: Job) -> tuple[dict, Trainer]:
    """Per rank, inside a launched worker group: the job trained in a process group of its
    own; its summary, and the trainer (closed) for what the test wants to read from it."""
    runtime = init_runtime(job.output_dir, 120)
    try:
        trainer = Trainer.build(job, runtime, None)
        try:
            return trainer.train(), trainer
        finally:
            trainer.close()
    finally:
        shutdown()


class LaunchedOnce:
    """`launched_once(*overrides)` → (rank 0's summary, final weights), as `launch_job` gives,
    but each distinct list of overrides launched at most once per session: a reference run
    (one process, an uninterrupted run to resume against) that several tests compare with
    costs one launch, not one per test. Its outputs stay in the session's temporary folder
    (`output_dir(*overrides)`). Callers only read what they get: the weights are shared."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.factory = tmp_path_factory
        self.runs: dict[tuple[str, ...], tuple[Path, dict, dict]] = {}

    def _run(self, overrides: tuple[str, ...]) -> tuple[Path, dict, dict]:
        if overrides not in self.runs:
            out = self.factory.mktemp("launched")
            self.runs[overrides] = (out, *launch_job(list(overrides), out))
        return self.runs[overrides]

    def __call__(self, *overrides: str) -> tuple[dict, dict]:
        _, summary, weights = self._run(overrides)
        return summary, weights

    def output_dir(self, *overrides: str) -> Path:
        return self._run(overrides)[0]


@pytest.fixture(scope="session")
def launched_once(tmp_path_factory) -> LaunchedOnce:
    return LaunchedOnce(tmp_path_factory)


def run_cli(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m mgpu ARGS` in `cwd`, tracking into `cwd/mlflow.db`."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}",
           "MGPU_CACHE_DIR": str(cwd / ".cache")}  # what a run caches of the machine
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "mgpu", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


def mlflow_runs(cwd: Path) -> list:
    """Every run in the store under `cwd` (none if the store was never created)."""
    if not (cwd / "mlflow.db").exists():
        return []
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments) if experiments else []


@pytest.fixture(autouse=True)
def unit_tests_start_no_process_group(request, monkeypatch):
    """A test without the `dist` or `e2e` marker fails if it starts a process group, in this
    process or as a worker group: unmarked, it would run in `make test-fast`, whose budget
    (< 2 minutes on 2 cores) holds only because no unit test launches anything."""
    if request.node.get_closest_marker("dist") or request.node.get_closest_marker("e2e"):
        return

    def refuse(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts a process group: mark it "
                    "@pytest.mark.dist", pytrace=False)

    monkeypatch.setattr(dist, "init_process_group", refuse)
    monkeypatch.setattr(elastic_launch, "__call__", refuse)


@pytest.fixture
def cli(request, tmp_path: Path):
    """`cli(*args)` runs the CLI in `tmp_path`; only `e2e` tests may (see the tiers above)."""
    if not request.node.get_closest_marker("e2e"):
        pytest.fail(f"{request.node.nodeid} runs the CLI: mark it @pytest.mark.e2e",
                    pytrace=False)
    return lambda *args, **kw: run_cli(list(args), tmp_path, **kw)


@pytest.fixture
def one_rank_group(tmp_path):
    """A real one-process gloo group: enough for DDP to call its comm hooks."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    shutdown()
