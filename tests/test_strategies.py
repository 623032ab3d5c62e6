"""Strategies beyond DDP on real gloo process groups, each checked against one process."""

from __future__ import annotations

import pytest

from mgpu.errors import ConfigError
from tests.conftest import launch_job, make_job
from tests.test_ddp import SGD, assert_weights_close

GPT = [*SGD, "model=gpt"]
# Sharded and split computations sum in a different order than one process: float32 noise.
ATOL = 1e-5


@pytest.mark.dist
def test_data_parallel_strategies_match_single_and_shard_memory(tmp_path):
    """ddp, zero1, fsdp (ZeRO-3) and tp on 2 ranks == one process; sharding shrinks memory."""
    single, single_w = launch_job([*GPT, "strategy=single"], tmp_path / "single")
    runs = {}
    for name in ("ddp", "zero1", "fsdp", "tp"):
        runs[name], weights = launch_job([*GPT, f"strategy={name}"], tmp_path / name)
        assert_weights_close(weights, single_w, atol=ATOL)
        assert runs[name]["train/loss"] == pytest.approx(single["train/loss"], abs=ATOL)
    ddp_params = runs["ddp"]["memory/param_bytes_per_rank"]
    ddp_optim = runs["ddp"]["memory/optimizer_bytes_per_rank"]
    assert ddp_params == single["memory/param_bytes_per_rank"] > 0
    assert ddp_optim == single["memory/optimizer_bytes_per_rank"] > 0  # SGD momentum
    fsdp = sum(runs["fsdp"][f"memory/{kind}_bytes_per_rank"] for kind in ("param", "optimizer"))
    assert fsdp <= 1.1 * (ddp_params + ddp_optim) / 2
    assert runs["zero1"]["memory/optimizer_bytes_per_rank"] == pytest.approx(ddp_optim / 2, rel=0.1)
    assert runs["zero1"]["memory/param_bytes_per_rank"] == ddp_params
    assert runs["tp"]["memory/param_bytes_per_rank"] < ddp_params


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=tp"], "strategy=tp needs a model with a tensor-parallel plan; model MLP"),
        (
            ["strategy=tp", "model=gpt", "launch.nproc_per_node=3", "data.batch_size=48"],
            "strategy tp=3: must divide model.heads=4",
        ),
        (["strategy=fsdp", "strategy.activation_checkpointing=some"],
         "strategy.activation_checkpointing=some: use one of none, full, selective"),
    ],
)
def test_bad_strategy_settings_are_one_config_error(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        make_job(overrides, tmp_path)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
