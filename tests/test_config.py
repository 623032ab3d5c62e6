"""Composition and validation: every option builds; every bad input is one clear ConfigError."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate

from mgpu.config import GROUPS, instantiate_settings
from tests.conftest import CONF, assert_refused, make_job

OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_instantiates(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if group == "strategy" and option == "single":
        overrides.append("launch.nproc_per_node=auto")
    if group == "strategy" and option in ("tp", "pp", "hybrid"):
        overrides.append("model=gpt")  # strategies that split the model need one that can be
    job = make_job(overrides, tmp_path)
    assert job[group]["_target_"].startswith(f"mgpu.{group}.")
    data = instantiate(job["data"])
    train_set, val_set = data.splits(job["seed"])
    assert len(train_set) > len(val_set) > 0
    model = instantiate(job["model"], input_shape=data.input_shape, num_classes=data.num_classes)
    inputs, _ = train_set[:4]
    assert model(inputs).shape == (4, data.num_classes)
    for name in ("strategy", "precision", "compression", "network", "balance", "optim"):
        assert instantiate_settings(job[name]) is not None


def test_auto_nproc_follows_the_strategy(tmp_path):
    assert make_job(["strategy=single"], tmp_path)["launch"]["world_size"] == 1
    assert make_job(["strategy=ddp"], tmp_path)["launch"]["world_size"] == 2
    assert make_job(["strategy=ddp", "launch.nproc_per_node=4"], tmp_path)["launch"][
        "world_size"
    ] == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+strategy.bucket_cap=3"], "strategy.bucket_cap: unknown key"),
        (["+train.foo=1"], "train.foo: Key 'foo' not in 'TrainConf'"),
        (["optim.lr=fast"], "optim.lr=fast"),
        (["model.hidden=[a]"], "model.hidden"),
        (["launch.nproc_per_node=0"], "launch.nproc_per_node=0: must be >= 1"),
        (["launch.nproc_per_node=two"], "launch.nproc_per_node=two"),
        (["launch.nnodes=3:2"], "launch.nnodes=3:2"),
        (["data.batch_size=63"], "data.batch_size=63: must be divisible by world size (2)"),
        (["train.grad_accum=3"], "data.batch_size=64: must be divisible"),
        (["strategy=single", "launch.nproc_per_node=2"], "strategy=single runs one process"),
        (["train.warmup_steps=-1"], "train.warmup_steps=-1: must be >= 0"),
        (["optim.lr=-1"], "optim.lr=-1.0: must be > 0"),
        (["optim.schedule=linear"], "optim.schedule=linear"),
        (["fault.mode=explode"], "fault.mode=explode"),
        (["fault.mode=exception", "fault.kill_rank=2"], "fault.kill_rank=2"),
        (["data.val_fraction=1.5"], "data.val_fraction=1.5"),
    ],
)
def test_bad_input_is_one_config_error_naming_the_key(overrides, message, tmp_path):
    assert_refused(overrides, message, tmp_path)
