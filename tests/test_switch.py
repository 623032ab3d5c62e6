"""Switching strategy mid-run (`switch`): at `switch.when.at_step` the run saves a checkpoint,
its worker group ends, and the group is launched again with `switch.to`, resuming that
checkpoint in the same MLflow run. It must end exactly where a run that the user resumed
with the new strategy from the same step ends, and its run must show one loss curve."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from mgpu.checkpoint import step_dir
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
