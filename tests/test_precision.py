"""Precision options: padding, loss scaling, non-finite steps, training to accuracy under DDP."""

from __future__ import annotations

import copy
import dataclasses
import math
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from mgpu import tracking
from mgpu.job import Job
from mgpu.launch import launch
from mgpu.model.cnn import CNN
from mgpu.model.mlp import MLP
from mgpu.precision.amp import AMP
from mgpu.precision.fp32 import FP32
from mgpu.precision.padding import PaddedLinear, pad_linear_layers
from mgpu.runtime import init_runtime, shutdown
from mgpu.trainer import Trainer
from tests.conftest import QUICK, assert_refused, make_job, mlflow_runs

# ---------------------------------------------------------------------------------------------
# Padding


@pytest.mark.parametrize(
    "build",
    [
        lambda: MLP(input_shape=(1, 5, 5), num_classes=10, hidden=[30, 45]),
        lambda: CNN(input_shape=(3, 6, 6), num_classes=7, channels=[4, 6], hidden=13),
    ],
    ids=["mlp", "cnn"],
)
def test_padded_model_computes_what_the_unpadded_one_does(build):
    torch.manual_seed(0)
    plain = build()
    padded = pad_linear_layers(copy.deepcopy(plain), 8)
    layers = [m for m in padded.modules() if isinstance(m, PaddedLinear)]
    assert layers and all(s % 8 == 0 for m in layers for s in m.weight.shape)
    assert not [m for m in padded.modules() if isinstance(m, torch.nn.Linear)
                and (m.in_features % 8 or m.out_features % 8)]
    inputs = torch.rand(16, *((1, 5, 5) if isinstance(plain, MLP) else (3, 6, 6)))
    labels = torch.randint(0, 7, (16,))
    torch.testing.assert_close(padded(inputs), plain(inputs), rtol=1e-5, atol=1e-6)
    # Training keeps them equal: the padding gets zero gradients and stays zero.
    for model in (plain, padded):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            F.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(padded(inputs), plain(inputs), rtol=1e-4, atol=1e-5)
    for m in layers:
        assert not m.weight[m.out_features:].any() and not m.weight[:, m.in_features:].any()


# ---------------------------------------------------------------------------------------------
# Settings


def test_amp_knobs_come_from_the_command_line(tmp_path):
    job = make_job(["precision=amp", "precision.init_scale=32768"], tmp_path)
    assert job.precision["init_scale"] == 32768.0
    assert job.precision["growth_interval"] == 2000


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("precision.backoff_factor=1", "precision.backoff_factor=1.0: must be in (0, 1)"),
        ("precision.backoff_factor=0", "precision.backoff_factor=0.0: must be in (0, 1)"),
        ("precision.growth_factor=1", "precision.growth_factor=1.0: must be > 1"),
        ("precision.init_scale=0", "precision.init_scale=0.0: must be > 0"),
        ("precision.growth_interval=0", "precision.growth_interval=0: must be >= 1"),
        ("precision.pad_to_multiple_of=0", "precision.pad_to_multiple_of=0: must be >= 1"),
        ("precision.max_nonfinite_steps=0", "precision.max_nonfinite_steps=0: must be >= 1"),
    ],
)
def test_bad_scaler_settings_are_one_config_error(override, message, tmp_path):
    assert_refused(["precision=amp", override], message, tmp_path)


def test_scaler_state_round_trips_through_state_dict():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = AMP(init_scale=256.0, growth_interval=2)
    first.attach(model, torch.device("cpu"))
    for _ in range(3):  # grows once (after 2 clean steps), then one more clean step
        with first.autocast(torch.device("cpu")):
            loss = model(torch.randn(3, 4)).float().sum()
        first.backward(loss)
        first.step(optimizer)
        optimizer.zero_grad()
    assert first.metrics() == {"amp/loss_scale": 512.0, "train/skipped_steps": 0}
    second = AMP(init_scale=256.0, growth_interval=2)
    second.attach(model, torch.device("cpu"))
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == first.state_dict()
    assert second.state_dict()["growth_tracker"] == 1  # one clean step since the growth
    assert second.metrics()["amp/loss_scale"] == 512.0


@pytest.mark.parametrize("make_precision", [FP32, AMP], ids=["fp32", "amp"])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_nonfinite_loss_skips_the_step_even_where_its_gradients_are_finite(make_precision, bad):
    # The constant adds nothing to the gradients: only the loss is not finite. Under DDP the
    # skip must come from the gradients (the one thing the ranks share), so they must say it.
    model = torch.nn.Linear(4, 2)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = make_precision()
    precision.attach(model, torch.device("cpu"))
    precision.backward(model(torch.randn(3, 4)).sum() + bad)
    assert all(p.grad.isnan().any() for p in model.parameters())
    assert precision.step(optimizer) is False
    assert precision.metrics()["train/skipped_steps"] == 1
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    # A finite loss afterwards trains as usual: backward starts from exactly 1.
    optimizer.zero_grad()
    inputs = torch.randn(3, 4)
    precision.backward(model(inputs).sum())
    assert precision.step(optimizer) is True
    expected = inputs.sum(0).expand(2, 4)
    torch.testing.assert_close(model.weight, before["weight"] - 0.1 * expected, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# Training under DDP: accuracy, loss against fp32, and one injected inf gradient

# 40 steps at a higher lr than the default reach >= 0.88 on digits; one point per step.
TRAIN = [*QUICK, "train.steps=40", "train.log_every=1", "optim.lr=5e-3", "strategy=ddp"]
INF_AT = 6  # rank 1's gradient is made +inf at this step (before DDP's all-reduce)
FAULT = ["fault.mode=nonfinite_grad", f"fault.at_step={INF_AT}", "fault.kill_rank=1"]
# Small scale and interval so the scaler's backoff and growth both show within 40 steps.
SCALER = ["precision.init_scale=1024", "precision.growth_interval=4"]
# Loss tolerance against fp32, per step: |loss - loss_fp32| <= 0.02 + 2% of loss_fp32.
# bf16 keeps 8 mantissa bits, fp16 11: measured on this run, the largest gap over the 40 steps
# was 0.0115 for bf16 and 0.0028 for amp (the loss starts at 2.3).
LOSS_ATOL, LOSS_RTOL = 0.02, 0.02


def train_and_save_every_rank(job: Job, run_id: str | None, env: dict | None = None,
                              request: object = None) -> dict:
    """worker.main, but every rank saves its own weights, to compare the replicas."""
    runtime = init_runtime(job.output_dir, job.launch.timeout_s)
    try:
        return train_and_save(job, runtime, run_id)
    finally:
        shutdown()  # after the run is freed (see `shutdown`)


def train_and_save(job: Job, runtime, run_id: str | None) -> dict:
    trainer = Trainer.build(job, runtime, run_id)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    torch.save(trainer.model.module.state_dict(), runtime.output_dir / f"rank{runtime.rank}.pt")
    return summary


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite MLflow store for the module (creating one takes ~2 s)."""
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    uri = f"sqlite:///{path}"
    MlflowClient(uri).search_experiments()
    return uri


def launch_tracked(overrides: list[str], out, uri: str, monkeypatch) -> tuple[dict, dict]:
    """Launch with MLflow tracking; returns ({rank: summary}, {metric: [value per step]})."""
    job = make_job(overrides, out)
    job = dataclasses.replace(
        job, tracking=dataclasses.replace(job.tracking, enabled=True, uri=uri))
    run_id = tracking.start_job_run(job, {}, overrides)
    monkeypatch.setattr("mgpu.launch.worker.main", train_and_save_every_rank)
    results = launch(job, run_id, env={})
    client = MlflowClient(uri)
    history = {
        key: [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
        for key in ("train/loss", "amp/loss_scale", "train/skipped_steps")
    }
    return results, history


class ScaledFP32(AMP):
    """amp's loss scaling on fp32 compute (no autocast): with the scale a power of two, scaling
    the loss and unscaling the gradients are exact, so training must be fp32's to the bit."""

    param_dtype = torch.float32

    def autocast(self, device: torch.device) -> AbstractContextManager:
        return nullcontext()


# Each launched precision's overrides.
PRECISIONS = {
    "fp32": ["precision=fp32"],
    "bf16": ["precision=bf16"],
    "amp": ["precision=amp", *SCALER],
    "scaled_fp32": ["precision=amp", "precision._target_=tests.test_precision.ScaledFP32",
                    *SCALER],
}


@pytest.fixture(scope="module")
def launched(store, tmp_path_factory):
    """precision → (results, history, output dir) of its DDP run, launched once per module."""
    cache = {}

    def get(precision: str) -> tuple[dict, dict, object]:
        if precision not in cache:
            out = tmp_path_factory.mktemp(precision)
            with pytest.MonkeyPatch.context() as monkeypatch:
                results, history = launch_tracked(
                    [*TRAIN, *FAULT, *PRECISIONS[precision]], out, store, monkeypatch
                )
            cache[precision] = (results, history, out)
        return cache[precision]

    return get


def rank_weights(out) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


@pytest.mark.dist
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp"])
def test_ddp_trains_and_skips_the_inf_step_on_every_rank(precision, launched):
    results, history, out = launched(precision)
    assert results[0]["eval/accuracy"] >= 0.88
    # The step with the inf gradient was skipped, once, on both ranks alike.
    skipped = history["train/skipped_steps"]
    assert skipped[INF_AT - 2] == 0 and skipped[INF_AT - 1] == 1 and skipped[-1] == 1
    assert results[0]["train/skipped_steps"] == results[1]["train/skipped_steps"] == 1
    rank0, rank1 = rank_weights(out)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert all(math.isfinite(loss) for loss in history["train/loss"])
    scales = history["amp/loss_scale"]
    if precision != "amp":
        assert scales == [] and "amp/loss_scale" not in results[0]  # only amp scales the loss
        return
    # Scale after each step: x2 after 4 clean steps (step 4), x0.5 at the inf (step 6), then
    # x2 again only after 4 more clean steps (step 10).
    assert scales[:INF_AT + 4] == [1024, 1024, 1024, 2048, 2048, 1024, 1024, 1024, 1024, 2048]


@pytest.mark.dist
@pytest.mark.parametrize("precision", ["bf16", "amp"])
def test_low_precision_loss_tracks_fp32(precision, launched):
    """Loss per step within the tolerance of fp32's (all of them skipped the same step)."""
    losses, fp32_losses = (launched(p)[1]["train/loss"] for p in (precision, "fp32"))
    assert len(losses) == len(fp32_losses) == 40
    for step, (loss, ref) in enumerate(zip(losses, fp32_losses, strict=True), start=1):
        assert abs(loss - ref) <= LOSS_ATOL + LOSS_RTOL * ref, (step, loss, ref)


@pytest.mark.dist
def test_a_loss_scale_that_grows_and_backs_off_leaves_fp32_training_unchanged(launched):
    """A constructed scale change: amp's loss scaling alone, on fp32 compute, its scale
    doubling every 4 clean steps and halving at the inf step. Powers of two scale and unscale
    exactly, so each step's loss and the final weights equal fp32's bitwise; unscaling by any
    scale other than the one the gradients carry would show."""
    _, history, out = launched("scaled_fp32")
    _, fp32_history, fp32_out = launched("fp32")
    scales = history["amp/loss_scale"]
    assert scales[:INF_AT + 4] == [1024, 1024, 1024, 2048, 2048, 1024, 1024, 1024, 1024, 2048]
    assert scales[-1] == 1024 * 2 ** ((40 - INF_AT) // 4)  # and kept growing
    assert history["train/loss"] == fp32_history["train/loss"]
    assert history["train/skipped_steps"] == fp32_history["train/skipped_steps"]
    for scaled, plain in zip(rank_weights(out), rank_weights(fp32_out), strict=True):
        for name in plain:
            assert torch.equal(scaled[name], plain[name]), name


@pytest.mark.dist
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp"])
def test_every_precision_runs_single_process_with_padding(precision, tmp_path):
    job = make_job([*QUICK, "train.steps=10", "strategy=single", f"precision={precision}",
                    "precision.pad_to_multiple_of=8"], tmp_path)
    summary = launch(job, run_id=None, env={})[0]
    assert math.isfinite(summary["train/loss"]) and summary["train/skipped_steps"] == 0
    # Trained with the head padded to 16 outputs, saved at the model's own 10.
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert weights["head.weight"].shape == (10, 256) and weights["head.bias"].shape == (10,)
    MLP(input_shape=(1, 8, 8), num_classes=10, hidden=[256, 256]).load_state_dict(weights)


# ---------------------------------------------------------------------------------------------
# The command line


@pytest.mark.e2e
def test_amp_run_is_tagged_and_logs_the_loss_scale(cli, tmp_path):
    result = cli(*QUICK, "precision=amp", "precision.init_scale=32768")
    assert result.returncode == 0, result.stderr
    [run] = mlflow_runs(tmp_path)
    assert run.data.tags["precision"] == "amp"
    assert run.data.params["precision.init_scale"] == "32768.0"
    assert run.data.metrics["amp/loss_scale"] == 32768.0
    assert run.data.metrics["train/skipped_steps"] == 0


@pytest.mark.e2e
def test_too_many_nonfinite_steps_fail_the_run_naming_the_step(cli, tmp_path):
    # A learning rate this large blows the weights up: every step after that is non-finite.
    result = cli(*QUICK, "optim=sgd", "optim.lr=1e12", "precision.max_nonfinite_steps=3")
    assert result.returncode == 1
    assert "3 optimizer steps in a row had a non-finite loss or gradient" in result.stderr
    assert "the last at step" in result.stderr
    [run] = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
    assert "precision.max_nonfinite_steps=3" in run.data.tags["mgpu.error"]


@pytest.mark.e2e
def test_bad_scaler_setting_stops_the_cli_with_one_line(cli, tmp_path):
    result = cli("precision=amp", "precision.backoff_factor=1")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("mgpu: config error: precision.backoff_factor=1.0")
    assert not mlflow_runs(tmp_path)
