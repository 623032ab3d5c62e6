"""Every stateful part resumes exactly: a run whose rank is killed after a checkpoint and whose
group restarts from it ends bitwise equal to the run that was never interrupted.

Real gloo worker groups and real DCP checkpoints on disk, one stateful part per case. Each run
is short (16 steps, checkpoints at 8 and 16); the killed run loses rank 1 at step 11, so the
restarted group resumes at step 8 and must redo steps 9-16 exactly as the first run did.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import launch_job
from tests.test_ddp import assert_weights_close

SHORT = ["train.steps=16", "train.warmup_steps=2", "train.log_every=4", "eval.every_steps=0",
         "checkpoint.every_steps=8"]
KILLED = ["fault.mode=sigkill", "fault.kill_rank=1", "fault.at_step=11", "launch.max_restarts=1"]
# Over DDP's 1 MiB first bucket: the single bucket of a run's first step is rebuilt into two
# after it, so state kept per bucket must follow its parameters into another layout, on every
# resume too (the resumed run's first step has the single bucket again).
TWO_BUCKETS = ["model.hidden=[512,512]"]

PARTS = {
    "zero1_optimizer_partitions": ["strategy=zero1"],
    "onebit_residuals": ["compression=onebit", "compression.warmup_steps=2", *TWO_BUCKETS],
    "ssp_queue": ["balance=ssp", "balance.staleness=2"],
    "powersgd_error_and_q": ["compression=powersgd", "compression.start_powerSGD_iter=2",
                             *TWO_BUCKETS],
}
# torch's PowerSGD hook runs its matmuls in gloo's callback threads, whose MKL/OpenMP thread
# count is not the worker's (`torch.set_num_threads` sets the calling thread's): which thread
# ran a callback is a race, and two uninterrupted runs differ by ~1e-7. Bitwise equality needs
# every thread's count set before torch loads (OMP_NUM_THREADS=1 gives it); here the bound
# is 1e-5, two orders below what losing the error and Q memories costs (~4e-3).
ATOL = {"powersgd_error_and_q": 1e-5}


@pytest.fixture
def uninterrupted(launched_once):
    """part -> (summary, weights) of its run without a fault, launched once per session."""
    return lambda part: launched_once(*SHORT, *PARTS[part])


def rank0_log(output_dir: Path) -> str:
    return (output_dir / "logs" / "rank0.log").read_text()


@pytest.mark.dist
@pytest.mark.parametrize("part", PARTS)
def test_killed_run_resumes_bitwise(part, uninterrupted, tmp_path):
    clean, clean_weights = uninterrupted(part)
    summary, weights = launch_job([*SHORT, *PARTS[part], *KILLED], tmp_path)
    assert list(tmp_path.glob("logs/elastic/*/attempt_1")), "the group was not restarted"
    assert "resumed from" in rank0_log(tmp_path) and "(step 8," in rank0_log(tmp_path)
    if part in ATOL:
        assert_weights_close(weights, clean_weights, atol=ATOL[part])
        assert summary["eval/loss"] == pytest.approx(clean["eval/loss"], abs=ATOL[part])
        return
    for name in clean_weights:
        assert torch.equal(weights[name], clean_weights[name]), name
    assert summary["eval/loss"] == clean["eval/loss"]
    assert summary["eval/accuracy"] == clean["eval/accuracy"]


ZERO1_SGD = [*SHORT, "strategy=zero1", "optim=sgd", "data.batch_size=48"]  # 48: 2 or 3 ranks


@pytest.mark.dist
def test_zero1_resumes_at_another_world_size(tmp_path):
    """Saved by 2 ranks, each its partition of the momentum buffers, resumed by 3: each rank
    loads its new partition by parameter name and the run goes on as the 2-rank one did (SGD:
    the world size changes only the rounding of the averaged gradients)."""
    _, two_ranks = launch_job(ZERO1_SGD, tmp_path / "two")
    root = tmp_path / "three" / "checkpoints"
    shutil.copytree(tmp_path / "two" / "checkpoints" / "step_00000008", root / "step_00000008")
    _, three_ranks = launch_job([*ZERO1_SGD, "launch.nproc_per_node=3", f"checkpoint.dir={root}"],
                                tmp_path / "three")
    assert "(step 8, saved at world size 2)" in rank0_log(tmp_path / "three")
    assert_weights_close(three_ranks, two_ranks, atol=1e-5)


THROUGHPUT = ["train.steps=8", "train.warmup_steps=2", "train.log_every=4", "eval.every_steps=0",
              "balance=throughput", "balance.warmup_steps=3", "balance.rebalance_every=100",
              "balance.hysteresis=0"]
REBALANCED = re.compile(r"step 4: split \[32, 32\] -> \[([\d, ]+)\] \(slowest rank predicted "
                        r"[\d.]+ -> [\d.]+ ms; (ms fixed \+ per sample, per rank: [^)]+)\)")


@pytest.mark.dist
def test_throughput_resumes_with_its_split_and_fitted_step_times(tmp_path):
    """Rank 1 twice as slow: the split moves at step 4, once (the next rebalancing would be at
    step 104). The checkpoint at step 6 holds it; rank 1 dies at step 7, and the restarted
    group goes on with that split and those fitted step times, not an equal split. Resumed by
    one rank, the run starts from the equal split and says so."""
    killed = tmp_path / "killed"
    summary, _ = launch_job(
        [*THROUGHPUT, "straggler.slowdown=[1.0,2.0]", "checkpoint.every_steps=6",
         "fault.mode=sigkill", "fault.kill_rank=1", "fault.at_step=7", "launch.max_restarts=1"],
        killed)
    log = rank0_log(killed)
    [(split, fitted)] = REBALANCED.findall(log)
    assert f"resumed from {killed / 'checkpoints' / 'step_00000006'}" in log
    assert f"balance: resumed with split [{split}] ({fitted})" in log
    sizes = [int(size) for size in split.split(", ")]
    assert [summary["balance/batch_rank0"], summary["balance/batch_rank1"]] == sizes
    assert summary["balance/rebalances"] == 1

    root = tmp_path / "one" / "checkpoints"
    shutil.copytree(killed / "checkpoints" / "step_00000006", root / "step_00000006")
    alone, _ = launch_job([*THROUGHPUT, "launch.nproc_per_node=1", f"checkpoint.dir={root}"],
                          tmp_path / "one")
    assert (f"balance: the checkpoint's split {sizes} is for 2 ranks; starting from an equal "
            "split over 1 ranks") in rank0_log(tmp_path / "one")
    assert alone["balance/batch_rank0"] == 64
