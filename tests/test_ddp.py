"""DDP on real gloo process groups, checked against one process on the same global batches."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import QUICK, launch_job

pytestmark = pytest.mark.dist
# SGD, not Adam: Adam turns 1e-9 float noise on near-zero gradients into lr-sized differences.
SGD = [*QUICK, "optim=sgd", "optim.lr=0.05"]


def assert_weights_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


# The one-process reference both parity tests compare with: launched once (`launched_once`).
SINGLE = [*SGD, "strategy=single"]


def test_ddp_matches_single_process(launched_once, tmp_path):
    single, single_w = launched_once(*SINGLE)
    ddp, ddp_w = launch_job([*SGD, "strategy=ddp", "launch.nproc_per_node=2"], tmp_path / "ddp")
    assert_weights_close(ddp_w, single_w, atol=1e-5)
    assert ddp["train/loss"] == pytest.approx(single["train/loss"], abs=1e-5)


def test_gradient_accumulation_matches_one_big_batch(launched_once, tmp_path):
    """2 ranks x 2 micro-batches of 16 (no_sync on the first) == one process on 64 samples."""
    _, single_w = launched_once(*SINGLE)
    _, accum_w = launch_job([*SGD, "strategy=ddp", "train.grad_accum=2"], tmp_path / "accum")
    assert_weights_close(accum_w, single_w, atol=1e-5)


def test_same_seed_is_bitwise_repeatable(tmp_path):
    """Three launches of their own: a cached run could not show that a second one repeats."""
    _, first = launch_job([*QUICK, "seed=3"], tmp_path / "a")
    _, second = launch_job([*QUICK, "seed=3"], tmp_path / "b")
    _, other = launch_job([*QUICK, "seed=4"], tmp_path / "c")
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert any(not torch.equal(first[n], other[n]) for n in first)
