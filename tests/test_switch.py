"""Switching strategy mid-run (`switch`): at `switch.when.at_step` the run saves a checkpoint,
its worker group ends, and the group is launched again with `switch.to`, resuming that
checkpoint in the same MLflow run. It must end exactly where a run that the user resumed
with the new strategy from the same step ends, and its run must show one loss curve.
A measured trigger (`switch.when.loss_plateau`) switches at the step its rule, as the README
states it, gives on the run's own logged loss curve."""

from __future__ import annotations

from statistics import mean

import pytest
import torch
from mlflow.tracking import MlflowClient

from mgpu.checkpoint import manifest, step_dir
from mgpu.job import SwitchWhen, ThroughputDrop
from mgpu.switch import Triggers
from tests.conftest import assert_refused, launch_job, mlflow_runs
from tests.test_relayout import GPT, LAYOUTS, SAVE_AT, STEPS, resume_as

SWITCHES = {"fsdp2": "{name:fsdp}", "tp2": "{name:tp}"}


@pytest.mark.dist
@pytest.mark.parametrize("to", SWITCHES)
def test_switch_ends_where_a_resume_with_the_new_strategy_ends(to, launched_once, tmp_path):
    launched_once(*GPT, *LAYOUTS["ddp2"])
    saved = step_dir(launched_once.output_dir(*GPT, *LAYOUTS["ddp2"]) / "checkpoints", SAVE_AT)
    resumed, resumed_weights = resume_as(GPT, saved, to, tmp_path / "resumed")

    switching = tmp_path / "switching"
    summary, weights = launch_job([*GPT, *LAYOUTS["ddp2"], f"switch.to={SWITCHES[to]}",
                                   f"switch.when.at_step={SAVE_AT}"], switching)
    log = (switching / "logs" / "rank0.log").read_text()
    assert f"resumed from {step_dir(switching / 'checkpoints', SAVE_AT)} (step {SAVE_AT}," in log
    for name in resumed_weights:
        assert torch.equal(weights[name], resumed_weights[name]), name
    for key in ("train/loss", "eval/loss", "eval/accuracy"):
        assert summary[key] == resumed[key], key


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_switched_run_is_one_mlflow_run_with_one_loss_curve(cli, tmp_path):
    result = cli(*GPT, "train.log_every=2", "switch.to={name:fsdp}",
                 f"switch.when.at_step={SAVE_AT}")
    assert result.returncode == 0, result.stderr
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(2, STEPS + 1, 2))  # each log point once
    metrics = run.data.metrics
    assert metrics["switch/at_step"] == SAVE_AT
    assert metrics["switch/bytes"] > 0 and metrics["switch/seconds"] > 0
    assert metrics["checkpoint/resumed_from_step"] == SAVE_AT
    # The planner's error figures compare one layout's prediction with what it measured: a
    # switched run measured two, so it logs the prediction alone.
    assert "plan/predicted_step_seconds" in metrics
    assert not {"plan/error_step_time", "plan/error_state_bytes"} & metrics.keys()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_out_of_memory_error_switches_from_the_last_checkpoint(cli, tmp_path):
    # Rank 1 fails at step 6 with torch.OutOfMemoryError; the last checkpoint is step 4.
    result = cli(*GPT, "train.log_every=2", "fault.mode=oom", "fault.kill_rank=1",
                 "fault.at_step=6", "switch.to={name:fsdp}", "switch.when.oom=true")
    assert result.returncode == 0, result.stderr
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["switch/at_step"] == SAVE_AT and metrics["switch/bytes"] > 0
    assert metrics["checkpoint/resumed_from_step"] == SAVE_AT
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(2, STEPS + 1, 2))  # step 6 never ended under ddp
    [checkpoints] = tmp_path.glob("outputs/*/*/checkpoints")
    assert manifest(step_dir(checkpoints, STEPS))["layout"]["dp_shard"] == 2  # fsdp saved it


def plateau_step(losses: dict[int, float], window: int, threshold: float, steps: int) -> int | None:
    """The README's loss_plateau rule on a train/loss curve logged at every step: the first
    step s < train.steps whose last `window` steps' mean loss fell by less than `threshold`,
    relative to the mean of the `window` steps before them; None if there is none."""
    for s in range(2 * window, steps):
        now = mean(losses[t] for t in range(s - window + 1, s + 1))
        before = mean(losses[t] for t in range(s - 2 * window + 1, s - window + 1))
        if (before - now) / before < threshold:
            return s
    return None


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_loss_plateau_switches_where_the_logged_curve_says(cli, tmp_path):
    steps, window, threshold = 12, 2, 0.02
    result = cli(*GPT, f"train.steps={steps}", "train.log_every=1", "switch.to={name:fsdp}",
                 f"switch.when.loss_plateau.window={window}",
                 f"switch.when.loss_plateau.threshold={threshold}")
    assert result.returncode == 0, result.stderr
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))  # one curve
    expected = plateau_step({m.step: m.value for m in history}, window, threshold, steps)
    assert expected is not None and expected > 2 * window  # not at the first step it may
    assert run.data.metrics["switch/at_step"] == expected
    assert run.data.metrics["checkpoint/resumed_from_step"] == expected


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_rerun_goes_on_with_the_strategy_the_run_switched_to(cli, tmp_path):
    # threshold=0.99: the plateau fires at the first log point it may, two windows in (step
    # 4); the run then fails under fsdp at step 9, its last checkpoint fsdp's at step 8. The
    # same command again resumes it with fsdp, not with the ddp it started with.
    checkpoints = tmp_path / "checkpoints"
    command = [*GPT, "train.steps=12", "train.log_every=2", "checkpoint.every_steps=2",
               f"checkpoint.dir={checkpoints}", "switch.to={name:fsdp}",
               "switch.when.loss_plateau.window=2", "switch.when.loss_plateau.threshold=0.99"]
    stopped = cli(*command, "fault.mode=exception", "fault.at_step=9")
    assert stopped.returncode != 0
    assert manifest(step_dir(checkpoints, 8))["layout"]["dp_shard"] == 2

    rerun = cli(*command)
    assert rerun.returncode == 0, rerun.stderr
    [run] = mlflow_runs(tmp_path)  # the same MLflow run goes on
    assert run.info.status == "FINISHED"
    assert run.data.metrics["switch/at_step"] == 4
    assert run.data.metrics["checkpoint/resumed_from_step"] == 8
    assert manifest(step_dir(checkpoints, 12))["layout"]["dp_shard"] == 2  # fsdp saved it


def test_a_throughput_drop_fires_at_the_first_window_below_its_fraction_of_the_best():
    # Log points every 2 steps, their mean step times; windows of 4 steps, so each window is
    # two points: 0.15 s/step at step 4 (warm-up), 0.1 at 6 (the best), 0.1 at 8, 0.115 at 10
    # (87% of the best's samples/s), 0.14 at 12 (71%: below 80%).
    when = SwitchWhen(throughput_drop=ThroughputDrop(window=4, fraction=0.8))
    triggers = Triggers(when, start_step=0, global_batch=64)
    step_times = {2: 0.2, 4: 0.1, 6: 0.1, 8: 0.1, 10: 0.13, 12: 0.15}
    fired = [step for step, step_s in step_times.items() if triggers.fires(step, 1.0, step_s)]
    assert fired == [12]


@pytest.mark.parametrize(("overrides", "message"), [
    (["compression=onebit", "switch.to={name:tp}", "switch.when.at_step=4"],
     "switch.to={name:tp} is refused: "),
    (["switch.to={name:single}", "switch.when.at_step=4"],
     "switch.to={name:single} is refused: strategy=single runs one process"),
    (["switch.to={name:fsdp}", "switch.when.at_step=30"],
     "switch.when.at_step=30: must be between 1 and train.steps - 1 = 9"),
    (["switch.to={name:zero3}", "switch.when.at_step=4"],
     "switch.to={name:zero3}: name must be a strategy option: ddp, fsdp"),
    (["switch.to={name:fsdp,shard:2}", "switch.when.at_step=4"],
     "switch.to={name:fsdp,shard:2}: strategy.shard: unknown key"),
    (["switch.to=auto", "switch.when.at_step=4"],
     "switch.to={name:auto}: strategy=auto picks a layout before launch, not mid-run"),
], ids=["support rule", "world size", "step", "name", "key", "auto"])
def test_a_switch_the_rules_forbid_is_refused_before_launch(overrides, message, tmp_path):
    assert_refused(["train.steps=10", *overrides], message, tmp_path)


@pytest.mark.parametrize(("overrides", "message"), [
    (["switch.to={name:fsdp}"],
     "switch.to={name:fsdp}: no trigger set; set switch.when.at_step, "
     "switch.when.loss_plateau.window, switch.when.throughput_drop.window or "
     "switch.when.oom=true"),
    (["switch.when.loss_plateau.window=2"],
     "switch.when.loss_plateau.window=2: no switch.to to switch to; name a strategy, e.g. "
     "switch.to={name:fsdp}"),
    (["switch.to={name:fsdp}", "switch.when.loss_plateau.window=3"],
     "switch.when.loss_plateau.window=3: must be a multiple of train.log_every=2 (the trigger "
     "reads the figures of log points), or 0 (off)"),
    (["switch.to={name:fsdp}", "switch.when.throughput_drop.window=6"],
     "switch.when.throughput_drop.window=6: two windows must fit before train.steps=10; use a "
     "window below 5 steps"),
    (["switch.to={name:fsdp}", "switch.when.loss_plateau.window=2",
      "switch.when.loss_plateau.threshold=1.5"],
     "switch.when.loss_plateau.threshold=1.5: a relative improvement per window in [0, 1), "
     "e.g. 0.01 (switch once the loss falls by less than 1% from one window to the next)"),
    (["switch.to={name:fsdp}", "switch.when.throughput_drop.window=2",
      "switch.when.throughput_drop.fraction=0"],
     "switch.when.throughput_drop.fraction=0.0: a share of the best window's samples/s in "
     "(0, 1), e.g. 0.8 (switch below 80% of it)"),
    (["switch.to={name:fsdp}", "switch.when.oom=true", "checkpoint.every_steps=0"],
     "switch.when.oom=true: an out-of-memory switch resumes the last checkpoint; set "
     "checkpoint.every_steps > 0"),
], ids=["no trigger", "no target", "window", "two windows", "threshold", "fraction",
        "oom without checkpoints"])
def test_a_bad_trigger_is_refused_in_one_line(overrides, message, tmp_path):
    line = assert_refused(["train.steps=10", "train.log_every=2", *overrides], message, tmp_path)
    assert line == message
