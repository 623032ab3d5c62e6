"""Evaluation: every sample scored on exactly one rank, with as many forward passes on every rank
(sharded strategies gather parameters in each forward, so a rank that stopped early would hang)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from mgpu.data.loader import IGNORED_LABEL, EvalBatches
from tests.test_balance import cpu_runtime
from tests.test_ddp import SGD
from tests.test_pipeline import launch_and_evaluate_alone

pytestmark = pytest.mark.timeout(600)


def numbered(size: int) -> TensorDataset:
    """Samples whose input and label are both their index."""
    return TensorDataset(torch.arange(size).float().unsqueeze(1), torch.arange(size))


@pytest.mark.parametrize(
    ("size", "world_size", "batch_size"),
    [(9, 2, 4), (819, 2, 409), (13, 4, 3), (3, 4, 2), (8, 2, 4)],
)
def test_every_rank_runs_as_many_batches_and_each_sample_counts_once(
    size, world_size, batch_size, tmp_path
):
    shares = [list(EvalBatches(numbered(size), batch_size, cpu_runtime(r, world_size, tmp_path)))
              for r in range(world_size)]
    assert len({len(share) for share in shares}) == 1
    assert all(0 < len(labels) <= batch_size for share in shares for _, labels in share)
    scored = torch.cat([labels for share in shares for _, labels in share])
    scored = scored[scored != IGNORED_LABEL]
    assert sorted(scored.tolist()) == list(range(size))


@pytest.mark.dist
def test_fsdp_eval_with_unequal_shards_finishes_and_equals_one_process(tmp_path):
    """819 held-out samples on 2 ranks in batches of 409: rank 0's 410 make two batches, rank
    1's 409 one. A hang would end at launch.timeout_s."""
    overrides = [*SGD, "strategy=fsdp", "data=synthetic", "eval.batch_size=409",
                 "launch.timeout_s=60"]
    summary, alone = launch_and_evaluate_alone(overrides, tmp_path, bf16=False)
    assert summary["eval/accuracy"] == alone["eval/accuracy"]
    assert summary["eval/loss"] == pytest.approx(alone["eval/loss"], rel=1e-6)
