"""The README tier: every command of a block README.md marks runnable is run, shortened by
overrides this test appends (Hydra takes an override's last value; the README text is never
edited), its exit code checked and the output lines the README quotes for it found in what it
printed; the Prometheus series the README lists are scraped from the run that asks for them.

All commands share one working directory and one MLflow store, in README order (the report
reads the sweeps run before it). Illustration blocks (multi-node, GPU presets, make targets)
are marked as such and not run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mgpu.monitor.prometheus import free_port
from tests.readme import Command, blocks, commands, normalized, prometheus_series
from tests.test_monitor import scrape, served_series

# One worker runs the whole tier under pytest-xdist, in README order, in one store.
pytestmark = pytest.mark.xdist_group("readme")

COMMANDS = commands()


def test_every_fenced_block_is_marked_runnable_or_illustration():
    unmarked = [line for line, marker, _ in blocks() if marker is None]
    assert not unmarked, (f"README.md blocks at lines {unmarked} have no marker before them: "
                          "<!-- runnable --> or <!-- illustration: why -->")
    assert len(COMMANDS) >= 20


def shortening(args: list[str]) -> list[str]:
    """The overrides appended to a README command so that it runs in seconds: few steps (but
    past the step a fault or the profiler names), no evaluation or checkpoints between (unless
    the command asks for them), small commbench messages, two optuna trials."""
    if any(a.startswith("--") for a in args):  # --cfg, --help: nothing runs
        return []
    given = dict(a.split("=", 1) for a in args if "=" in a)
    needed = [10]
    if "fault.at_step" in given:
        needed.append(int(given["fault.at_step"]) + 2)
    if "monitor.profile_start_step" in given:
        needed.append(int(given["monitor.profile_start_step"])
                      + int(given.get("monitor.profile_steps", 3)) + 1)
    steps = min([max(needed), int(given.get("train.steps", max(needed)))])
    extra = [f"train.steps={steps}"]
    extra += [f"{key}=0" for key in ("eval.every_steps", "checkpoint.every_steps")
              if key not in given]
    if given.get("task") == "commbench":
        extra += ["task.max_bytes=65536", "task.repeats=2", "task.warmup=1"]
    if "optuna" in given.get("experiment", "") + given.get("hydra/sweeper", ""):
        extra += ["hydra.sweeper.n_trials=2"]
    return extra


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


def run_with_prometheus(argv: list[str], cwd: Path, env: dict) -> tuple[int, str, set[str]]:
    """Run a command that asks for an exporter, on a free port, long enough to be scraped;
    returns its exit code, output and the series served while it trained."""
    port = free_port()
    argv = [*argv, f"monitor.prometheus_port={port}", "monitor.interval_s=0.5",
            "train.steps=600", "train.log_every=10"]
    expected = {name for name in prometheus_series() if not name.startswith("mgpu_gpu_")}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    served: set[str] = set()
    while proc.poll() is None and not expected <= served:
        served |= served_series(scrape(port))
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err, served


@pytest.mark.e2e
@pytest.mark.parametrize("command", COMMANDS, ids=[f"L{c.line}:{c.text[:60]}" for c in COMMANDS])
def test_readme_command(command: Command, workdir: Path):
    words = shlex.split(command.text, comments=True)
    assert words[0] == "python", f"a runnable block runs python commands: {command.text}"
    args = words[1:]
    runs_a_job = args[:2] == ["-m", "mgpu"]  # not mgpu.report, which reads the store
    argv = [sys.executable, *args, *(shortening(args[2:]) if runs_a_job else [])]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}"}
    env.pop("HYDRA_FULL_ERROR", None)
    if any(a.startswith("monitor.prometheus_port=") for a in args):
        code, output, served = run_with_prometheus(argv, workdir, env)
        listed = {name for name in prometheus_series() if not name.startswith("mgpu_gpu_")}
        assert served == listed, (f"listed but not served: {sorted(listed - served)}; "
                                  f"served but not listed: {sorted(served - listed)}")
    else:
        result = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                                timeout=300)
        code, output = result.returncode, result.stdout + result.stderr
    assert code == command.exit_code, output[-3000:]
    # The console is the run's progress and its result: DTensor's note that saving a hybrid
    # model's weights takes sequential all-gathers is not for the user (one per rank).
    assert "While redistributing from" not in output
    printed = {normalized(line) for line in output.splitlines()}
    missing = [q for q in command.quoted if normalized(q) not in printed]
    assert not missing, f"quoted in README.md but not printed: {missing}\n{output[-3000:]}"
