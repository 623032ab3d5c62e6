"""Random numbers per rank: one seed gives every rank the same initial weights, then each
data-parallel replica its own dropout masks, while ranks that share one replica (its tp and pp
peers) keep drawing the same numbers."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mgpu.launch import WORKER_ENV, environment
from mgpu.runtime import init_runtime, shutdown
from mgpu.trainer import Trainer
from tests.conftest import QUICK, launch_job, make_job
from tests.test_strategies import GPT

pytestmark = pytest.mark.timeout(600)
# Over 4 ranks: (data-parallel rank, tp rank) = (0,0) (0,1) (1,0) (1,1); (pp rank, dp rank) =
# (0,0) (0,1) (1,0) (1,1).
STRATEGIES = {
    "ddp": ["strategy=ddp", "launch.nproc_per_node=4"],
    "dp2_tp2": [*GPT, "strategy=hybrid", "strategy.dp=2", "strategy.tp=2"],
    "dp2_pp2": [*GPT, "strategy=hybrid", "strategy.dp=2", "strategy.pp=2"],
}


def draws_after_build(jobs: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Per rank: build each job's run in turn and draw from the global RNG right after."""
    runtime = init_runtime(next(iter(jobs.values())).output_dir, 120)
    draws = {}
    try:
        for name, job in jobs.items():
            trainer = Trainer.build(job, runtime, None)
            draws[name] = torch.rand(8)
            trainer.close()
            del trainer  # before its group (see `shutdown`)
        return draws
    finally:
        shutdown()


@pytest.mark.dist
def test_replicas_draw_apart_and_model_peers_draw_alike(tmp_path):
    jobs = {name: make_job(overrides, tmp_path / name) for name, overrides in STRATEGIES.items()}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=4, run_id="rng",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          start_method="spawn")
    with environment(WORKER_ENV):
        results = elastic_launch(config, draws_after_build)(jobs)

    def same(name: str, a: int, b: int) -> bool:
        return torch.equal(results[a][name], results[b][name])

    assert not any(same("ddp", a, b) for a in range(4) for b in range(a + 1, 4))
    assert same("dp2_tp2", 0, 1) and same("dp2_tp2", 2, 3) and not same("dp2_tp2", 0, 2)
    assert same("dp2_pp2", 0, 2) and same("dp2_pp2", 1, 3) and not same("dp2_pp2", 0, 1)


@pytest.mark.dist
def test_dropout_run_is_bitwise_repeatable(tmp_path):
    overrides = [*QUICK, "strategy=ddp", "model.dropout=0.2", "seed=3"]
    _, first = launch_job(overrides, tmp_path / "a")
    _, second = launch_job(overrides, tmp_path / "b")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
