"""Honest figures: step times without stalls, short runs, the loss of the global batch, bytes on
the wire per collective, and no metric where it does not apply."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mgpu import tracking
from mgpu.config import Job
from mgpu.launch import launch
from mgpu.meter import OtherLoad, StepMeter
from mgpu.model.mlp import MLP
from mgpu.monitor.timing import PhaseTimer
from mgpu.options import build
from mgpu.runtime import init_runtime, shutdown
from mgpu.trainer import Trainer
from tests.conftest import ROOT, launch_job, make_job, mlflow_runs

EVAL_SLEEP_S = 3.0


class SlowEvalMLP(MLP):
    """The MLP, with every evaluation batch taking at least `EVAL_SLEEP_S`: a stall of known
    length between training steps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            time.sleep(EVAL_SLEEP_S)
        return super().forward(x)


@pytest.mark.dist
def test_eval_and_checkpoint_stalls_stay_out_of_the_step_figures(tmp_path):
    """Evaluations of >= 3 s after steps 4 and 8, and checkpoints: the step figures keep none
    of it (all 10 timed steps together take less than 1.5 stalls, even on a loaded machine),
    and the stall is logged on its own as `time/eval_s`."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = make_job(["strategy=single", "model._target_=tests.test_figures.SlowEvalMLP",
                    "train.steps=12", "train.warmup_steps=2", "train.log_every=12",
                    "eval.every_steps=4", "checkpoint.every_steps=4"], tmp_path / "out")
    job = dataclasses.replace(
        job, tracking=dataclasses.replace(job.tracking, enabled=True, uri=uri))
    run_id = tracking.start_job_run(job, {}, [])
    summary = launch(job, run_id, env={})[0]

    timed_s = 10 * 64 / summary["train/samples_per_s"]  # the sum of the timed steps
    assert timed_s < 1.5 * EVAL_SLEEP_S, summary
    assert summary["time/step_p99_s"] < EVAL_SLEEP_S / 2, summary
    assert 0 < summary["time/log_point_s"] < EVAL_SLEEP_S / 2
    client = MlflowClient(uri)
    eval_s = client.get_metric_history(run_id, "time/eval_s")
    assert sorted(m.step for m in eval_s) == [4, 8]
    assert all(m.value >= EVAL_SLEEP_S for m in eval_s)
    assert len(client.get_metric_history(run_id, "checkpoint/save_s")) == 3
    # One process on fp32: no loss scaling, no communication, no straggler to name.
    assert summary["train/skipped_steps"] == 0
    assert not [k for k in summary if k.startswith(("amp/", "comm/", "time/slowest_rank"))]


@pytest.mark.e2e
def test_short_runs_cap_the_warmup_and_run_with_every_warmup_option(cli, tmp_path):
    """`train.steps=10` under defaults made for 500 steps: the training warm-up is capped at
    half the run (said once), and the options with warm-ups of their own run."""
    sweeps = (["compression=none,onebit,powersgd"], ["balance=throughput,ssp"])
    for sweep in sweeps:
        result = cli("-m", "train.steps=10", *sweep)
        assert result.returncode == 0, result.stderr[-3000:]
        log = result.stdout + result.stderr
        assert "train.warmup_steps=20 is more than half of train.steps=10: warm-up capped at 5" \
            in log
    jobs = [r for r in mlflow_runs(tmp_path) if "mlflow.parentRunId" in r.data.tags]
    assert len(jobs) == 5
    for run in jobs:
        assert run.info.status == "FINISHED"
        assert run.data.params["train.warmup_steps"] == "5"
        assert run.data.metrics["train/samples_per_s"] > 0
        assert run.data.metrics["eval/accuracy"] > 0.1


@pytest.mark.dist
def test_train_loss_is_the_global_batch_mean_under_an_uneven_split(tmp_path):
    """A straggler makes `balance=throughput` split 64 samples unevenly from step 6 on; the
    logged loss of steps 6-10 equals one process's on the same global batches."""
    common = ["optim=sgd", "optim.lr=0.05", "model.hidden=[512,512]", "train.steps=10",
              "train.warmup_steps=0", "train.log_every=5"]
    split, _ = launch_job([*common, "balance=throughput", "balance.warmup_steps=5",
                           "balance.hysteresis=0.0", "straggler.slowdown=[1.0,4.0]"],
                          tmp_path / "split")
    single, _ = launch_job([*common, "strategy=single"], tmp_path / "single")
    assert split["balance/batch_rank0"] > split["balance/batch_rank1"], "no uneven split"
    assert split["train/loss"] == pytest.approx(single["train/loss"], abs=1e-5)


def fp32_gradient_bytes(job: Job) -> int:
    data = build(job.data)
    model = build(job.model, input_shape=data.input_shape, num_classes=data.num_classes)
    return 4 * sum(p.numel() for p in model.parameters())


def train_each(jobs: dict[str, dict]) -> dict[str, dict]:
    """Per rank: each job's whole training loop in turn, on one process group."""
    runtime = init_runtime(next(iter(jobs.values())).output_dir, 120)
    summaries = {}
    try:
        for name, job in jobs.items():
            trainer = Trainer.build(job, runtime, None)
            try:
                summaries[name] = trainer.train()
            finally:
                trainer.close()
        return summaries
    finally:
        shutdown()


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_on_the_wire_follow_the_collective_at_each_world_size(world_size, tmp_path,
                                                                    monkeypatch):
    """Ring all-reduce of S bytes sends 2(W-1)/W x S per rank, all_gather of P bytes (W-1) x P:
    plain, fp16 and PowerSGD keep their ratio at any W, and so does onebit (about 32: at W > 2
    a compressed all-reduce, all_to_all then all_gather of N/8-byte messages). The monitor's
    bandwidth divides those same bytes by its measured time. Steps 4-6, after the warm-ups."""
    quick = ["strategy=ddp", f"launch.nproc_per_node={world_size}", "train.steps=6",
             "train.warmup_steps=0", "train.log_every=3", "eval.every_steps=0",
             "checkpoint.every_steps=0"]
    options = {
        "none": [],
        "fp16": ["compression=fp16"],
        "powersgd": ["compression=powersgd", "compression.start_powerSGD_iter=2"],
        "onebit": ["compression=onebit", "compression.warmup_steps=2", "monitor.enabled=true"],
    }
    jobs = {name: make_job([*quick, *extra], tmp_path / name) for name, extra in options.items()}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id="wire",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          start_method="spawn", monitor_interval=0.1, max_restarts=0)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as mgpu.launch does
    results = elastic_launch(config, train_each)(jobs)[0]

    ring = 2 * (world_size - 1) / world_size
    plain = ring * fp32_gradient_bytes(jobs["none"])
    for name, summary in results.items():
        # ratio = plain all-reduce of the same buckets / what was sent
        assert summary["comm/bytes_per_step"] * summary["comm/compression_ratio"] == \
            pytest.approx(plain, rel=1e-12), name
    assert results["none"]["comm/bytes_per_step"] == plain
    assert results["none"]["comm/compression_ratio"] == 1.0
    assert results["fp16"]["comm/compression_ratio"] == 2.0
    assert results["powersgd"]["comm/compression_ratio"] > 2
    onebit = results["onebit"]
    assert 30 <= onebit["comm/compression_ratio"] <= 32
    assert onebit["comm/bandwidth_GBps"] == pytest.approx(
        onebit["comm/bytes_per_step"] / onebit["comm/allreduce_s"] / 1e9, rel=1e-9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_check_without_cuda_says_so_and_succeeds():
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "no CUDA device" in result.stdout
    assert time.monotonic() - started < 60


SPIN = [sys.executable, "-c", "while True: pass"]


def test_other_load_counts_a_process_outside_the_job_and_not_the_jobs_own(monkeypatch):
    """A process spinning outside the job's tree shows as other load (one core of the machine's
    throughout, less whatever it lost to the rest of the machine); the job's own spinning
    process counts as the job's CPU time, not as other load."""
    outside = subprocess.Popen(SPIN)
    sleeper = subprocess.Popen(["sleep", "30"])  # the job's root: nothing runs under it
    try:
        monkeypatch.setenv("MGPU_JOB_PID", str(sleeper.pid))
        load = OtherLoad()
        load.start()
        time.sleep(2.0)
        # One core of `cores`, less what the spinning process lost to the rest of the machine.
        assert load.fraction() >= 0.4 / load.cores
    finally:
        outside.kill()
        sleeper.kill()
    monkeypatch.setenv("MGPU_JOB_PID", str(os.getpid()))
    load = OtherLoad()
    before = load.job_cpu_s()
    own = subprocess.Popen(SPIN)  # under this process: the job's own
    try:
        time.sleep(2.0)
        assert load.job_cpu_s() - before >= 0.5  # of its 2 s, the spinning child's CPU time
    finally:
        own.kill()


def test_warmup_counts_the_steps_of_this_process_after_a_resume():
    """A run resumed after step 10 with `train.warmup_steps=3` warms up again: its first 3
    steps (11-13, cold caches and all) stay out of the step and phase figures, and the
    machine's other load is measured over the 7 steps after them, so it is logged."""
    cpu = torch.device("cpu")
    meter = StepMeter(64, warmup_steps=3, device=cpu, other_load=OtherLoad())
    timer = PhaseTimer(cpu, warmup_steps=3)
    for step in range(11, 21):
        with timer.phase("forward"):
            pass
        meter.record(step, torch.tensor(1.0), samples=32)
        timer.end_step(step)
    timer.collect()
    assert len(meter.durations) == 7
    assert timer.run_steps == 7
    assert "host/other_cpu_fraction" in meter.throughput()


RANK1_EXTRA_BYTES = 1_500_000_000


class HeavyOnRank1MLP(MLP):
    """The MLP; rank 1 touches `RANK1_EXTRA_BYTES` of memory while building it, so its peak
    is that much above any other rank's."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int,
                 hidden: list[int] = (256, 256), dropout: float = 0.0) -> None:
        super().__init__(input_shape, num_classes, hidden, dropout)
        if dist.is_initialized() and dist.get_rank() == 1:
            torch.ones(RANK1_EXTRA_BYTES // 4).sum()


@pytest.mark.dist
def test_peak_memory_is_the_highest_of_any_rank(tmp_path):
    """Rank 1 peaks 1.5 GB higher than rank 0 (the process's peak resident set on CPU): the
    logged peak is rank 1's, not rank 0's own."""
    summary, _ = launch_job(["train.steps=2", "train.warmup_steps=0", "eval.every_steps=0",
                             "checkpoint.every_steps=0",
                             "model._target_=tests.test_figures.HeavyOnRank1MLP"], tmp_path)
    assert summary["memory/peak_bytes"] > RANK1_EXTRA_BYTES, summary["memory/peak_bytes"]
