"""Honest figures: step times without stalls, short runs, the loss of the global batch, bytes on
the wire per collective, and no metric where it does not apply."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from mgpu import tracking
from mgpu.compression.onebit import OneBit
from mgpu.job import Job
from mgpu.launch import launch
from mgpu.meter import OtherLoad, StepMeter
from mgpu.model.mlp import MLP
from mgpu.monitor.timing import PhaseTimer
from mgpu.runtime import init_runtime, shutdown
from mgpu.trainer import Trainer
from tests.conftest import (
    ROOT,
    launch_job,
    launch_ranks,
    make_job,
    mlflow_runs,
    train_on_this_rank,
)
from tests.oracle import initial_model

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


# Bytes per element of the dtypes the profiler names for a collective's input.
PROFILED_DTYPE_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "unsigned char": 1,
                        "long int": 8}


# Collectives launched from a future's callback (PowerSGD's P and Q) run on gloo's threads.
ALL_THREADS = _ExperimentalConfig(profile_all_threads=True)


def handed_to_collectives(trace: Path) -> dict[str, int]:
    """Bytes this rank handed to gloo, by collective, from a profiler trace: gloo itself
    records every collective it is given (DDP's own C++ all-reduce and torch's PowerSGD hook
    included), with the input's shape and dtype."""
    handed: dict[str, int] = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        name = event.get("name", "")
        if name.startswith("gloo:"):
            [dims], [dtype] = event["args"]["Input Dims"], event["args"]["Input type"]
            handed[name] = handed.get(name, 0) + math.prod(dims) * PROFILED_DTYPE_BYTES[dtype]
    return handed


def wire_bytes(handed: dict[str, int], world_size: int) -> float:
    """What those collectives send from one rank, by the ring algorithm: an all-reduce of S
    bytes is a reduce-scatter then an all-gather of W pieces of S/W, each passing W-1 pieces
    on; an all-gather of P bytes from every rank passes the W-1 other ranks' pieces on; an
    all-to-all of S bytes sends W-1 of its W pieces (its own stays)."""
    ring = {"gloo:all_reduce": 2 * (world_size - 1) / world_size,
            "gloo:all_gather": world_size - 1,
            "gloo:all_to_all": (world_size - 1) / world_size}
    return sum(ring[name] * nbytes for name, nbytes in handed.items())


def handed_in_steps(trainer: Trainer, steps: int, trace: Path) -> dict[str, int]:
    """Bytes this rank handed gloo's collectives in the trainer's next `steps` training steps
    (`handed_to_collectives`, from torch's profiler; its trace written to `trace`)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 experimental_config=ALL_THREADS) as prof:
        for _ in range(steps):
            trainer.train_step()
    prof.export_chrome_trace(str(trace))
    return handed_to_collectives(trace)


def measure_wire(jobs: dict[str, Job], warm: int, measured: int) -> dict[str, dict]:
    """Per rank, per job: `warm` steps, then `measured` steps under torch's profiler; the
    compression's figures for those steps beside the bytes gloo was handed in them."""
    runtime = init_runtime(next(iter(jobs.values())).output_dir, 120)
    results = {}
    try:
        for name, job in jobs.items():
            trainer = Trainer.build(job, runtime, None)
            try:
                for _ in range(warm):
                    trainer.train_step()
                trainer.compression.metrics()  # the window starts here
                handed = handed_in_steps(
                    trainer, measured, runtime.output_dir / f"{name}_trace_rank{runtime.rank}.json")
                figures = trainer.compression.metrics()
            finally:
                trainer.close()
            results[name] = {**figures, "handed": handed}
        return results
    finally:
        shutdown()


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_on_the_wire_are_what_gloo_was_handed(world_size, tmp_path, monkeypatch):
    """Each option's `comm/bytes_per_step` against the tensors gloo itself recorded being handed
    in the same steps (torch's profiler, at the process group), sent by the ring algorithm;
    its `comm/compression_ratio` against plain DDP's measured bytes over its own. Steps 4-6,
    after the options' warm-ups and DDP's re-bucketing."""
    quick = ["strategy=ddp", f"launch.nproc_per_node={world_size}", "checkpoint.every_steps=0"]
    options = {
        "none": [],
        "fp16": ["compression=fp16"],
        "bf16": ["compression=bf16"],
        "powersgd": ["compression=powersgd", "compression.start_powerSGD_iter=2"],
        "onebit": ["compression=onebit", "compression.warmup_steps=2"],
    }
    jobs = {name: make_job([*quick, *extra], tmp_path / name) for name, extra in options.items()}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id="wire",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          start_method="spawn", monitor_interval=0.1, max_restarts=0)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as mgpu.launch does
    measured = 3
    results = elastic_launch(config, measure_wire)(jobs, 3, measured)[0]

    wire = {name: wire_bytes(r["handed"], world_size) / measured for name, r in results.items()}
    for name, summary in results.items():
        assert summary["comm/bytes_per_step"] == pytest.approx(wire[name], rel=1e-12), name
        assert summary["comm/compression_ratio"] == pytest.approx(
            wire["none"] / wire[name], rel=1e-12), name
    # The measurement saw the compressions work: half the bytes, or far fewer; onebit's
    # compressed all-reduce (all_gather at W = 2, all_to_all then all_gather above) ~1/32.
    assert wire["fp16"] == wire["bf16"] == wire["none"] / 2
    assert wire["powersgd"] < wire["none"] / 2
    assert 30 <= wire["none"] / wire["onebit"] <= 32


HOLD_S = 0.1  # how long each bucket stays in flight after its all-gather


class HeldOneBit(OneBit):
    """onebit whose every bucket stays in flight `HOLD_S` after its all-gather completes (so a
    step's communication time is far longer than the microseconds between two clocks' marks),
    recording on its own clock each bucket's launch and completion, and the bytes of each
    payload it hands to the all-gather, by step."""

    def __init__(self) -> None:
        super().__init__(warmup_steps=0)
        self.step_number = 1
        self.intervals: list[tuple[int, float, float]] = []  # (step, launch, completion)
        self.handed: list[tuple[int, int]] = []  # (step, bytes handed to the all-gather)

    def all_gather(self, tensor, group):
        self.handed.append((self.step_number, tensor.nbytes))
        return super().all_gather(tensor, group)

    def hook(self, group, bucket):
        launched, step = time.perf_counter(), self.step_number
        held = torch.futures.Future()

        def release(fut: torch.futures.Future) -> None:
            def complete() -> None:
                self.intervals.append((step, launched, time.perf_counter()))
                held.set_result(fut.value())

            threading.Timer(HOLD_S, complete).start()

        super().hook(group, bucket).then(release)
        return held

    def end_step(self, applied: bool) -> None:
        super().end_step(applied)
        self.step_number += 1


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one was in flight."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def train_held(job: Job) -> dict:
    """Per rank: the job trained, its summary and its HeldOneBit's records."""
    summary, trainer = train_on_this_rank(job)
    held = trainer.compression
    return {"summary": summary, "intervals": held.intervals, "handed": held.handed}


@pytest.mark.dist
def test_bandwidth_is_bytes_handed_over_time_in_flight_measured_apart(tmp_path, monkeypatch):
    """`comm/bandwidth_GBps` against the bytes handed to the all-gather (sent to the W-1 other
    ranks) over the time some bucket was in flight, both recorded by the compression itself on
    its own clock: per step, the union of its buckets' launch-to-completion intervals, mean
    over the logged window (steps 4-6) and over ranks. Small buckets overlap in flight (a sum
    would be several times the union). The two clocks mark the same calls microseconds apart
    against a step's >= `HOLD_S` in flight: they agree within 3 % (0.1 % measured; GiB for
    GB would be 7 % off)."""
    job = make_job(["strategy=ddp", "launch.nproc_per_node=2", "train.steps=6",
                    "train.warmup_steps=0", "train.log_every=3", "eval.every_steps=0",
                    "checkpoint.every_steps=0", "monitor.enabled=true",
                    "network.bucket_cap_mb=0.05",
                    "compression._target_=tests.test_figures.HeldOneBit"], tmp_path)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="bandwidth",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          start_method="spawn", monitor_interval=0.1, max_restarts=0)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as mgpu.launch does
    results = elastic_launch(config, train_held)(job)

    window = (4, 5, 6)
    in_flight = [
        union_s([(a, b) for step, a, b in rank["intervals"] if step == s])
        for rank in results.values() for s in window
    ]
    buckets = [step for step, _, _ in results[0]["intervals"] if step == window[0]]
    assert len(buckets) > 1, "one bucket per step: nothing overlaps"
    handed = sum(nbytes for step, nbytes in results[0]["handed"] if step in window)
    wire_per_step = (2 - 1) * handed / len(window)  # an all-gather passes on the other's piece
    measured = wire_per_step / (sum(in_flight) / len(in_flight)) / 1e9
    assert results[0]["summary"]["comm/bandwidth_GBps"] == pytest.approx(measured, rel=0.03)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_check_without_cuda_says_so_and_succeeds():
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "no CUDA device" in result.stdout
    assert time.monotonic() - started < 60


SPIN = [sys.executable, "-c", "while True: pass"]


@pytest.mark.timing
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


@pytest.mark.dist
@pytest.mark.parametrize(("compression", "reduce_bytes"), [("none", 4), ("bf16", 2)])
def test_fsdp_bytes_per_step_are_its_all_gathers_and_reduce_scatters(
        compression, reduce_bytes, tmp_path):
    """strategy=fsdp on 2 ranks, blocks kept gathered to backward: each step all-gathers every
    parameter once (fp32) and reduce-scatters every gradient once (fp32, or bf16 where the
    compression sets FSDP's reduce dtype); a rank sends (W - 1) / W of each whole buffer."""
    overrides = ["strategy=fsdp", "strategy.reshard_after_forward=false",
                 f"compression={compression}", "train.steps=6", "train.log_every=3",
                 "eval.every_steps=0", "checkpoint.every_steps=0"]
    summary, _ = launch_job(overrides, tmp_path)
    params = sum(p.numel() for p in initial_model(make_job(overrides, tmp_path)).parameters())
    expected = (2 - 1) / 2 * params * (4 + reduce_bytes)
    assert summary["comm/bytes_per_step"] == expected


def measure_sends(job: Job, warm: int, measured: int) -> dict:
    """Per rank: `warm` steps, then `measured` steps under torch's profiler; the pipeline's
    figures for those steps beside the bytes this rank handed gloo's sends in them."""
    runtime = init_runtime(job.output_dir, 120)
    try:
        trainer = Trainer.build(job, runtime, None)
        try:
            for _ in range(warm):
                trainer.train_step()
            trainer.strategy.pipe.metrics()  # the window starts here
            handed = handed_in_steps(
                trainer, measured, runtime.output_dir / f"trace_rank{runtime.rank}.json")
            figures = trainer.strategy.pipe.metrics()
        finally:
            trainer.close()
        return {**figures, "handed": handed}
    finally:
        shutdown()


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_pipeline_bytes_per_step_are_what_its_ranks_handed_gloos_sends(schedule, tmp_path):
    """strategy=pp on 2 ranks: `comm/bytes_per_step` is the most bytes a rank handed gloo's
    point-to-point sends per step (torch's profiler, at the process group): activations one
    way, their gradients the other, the tied embedding's gradients both ways."""
    job = make_job(["model=gpt", "data=text", "model.dim=32", "strategy=pp",
                    f"strategy.schedule={schedule}", "checkpoint.every_steps=0",
                    "eval.every_steps=0"], tmp_path)
    measured = 3
    results = launch_ranks(measure_sends, 2, "sends", job, 3, measured)
    sent = [results[rank]["handed"].get("gloo:send", 0) / measured for rank in (0, 1)]
    assert min(sent) > 0, sent
    assert results[0]["comm/bytes_per_step"] == max(sent)


def measure_tp_wire(job: Job) -> dict:
    """Per rank: the bytes gloo's collectives were handed in the first training step and in
    the two after it (torch's profiler), beside the strategy's figures after them."""
    runtime = init_runtime(job.output_dir, 120)
    handed = []
    try:
        trainer = Trainer.build(job, runtime, None)
        try:
            for steps in (1, 2):
                handed.append(handed_in_steps(
                    trainer, steps,
                    runtime.output_dir / f"tp_trace{steps}_rank{runtime.rank}.json"))
            figures = trainer.strategy.metrics(trainer.model, trainer.optimizer)
        finally:
            trainer.close()
        return {**figures, "handed": handed}
    finally:
        shutdown()


@pytest.mark.dist
def test_tensor_parallel_bytes_per_step_are_what_dtensor_handed_gloo(tmp_path):
    """strategy=tp on 2 ranks: `comm/bytes_per_step`, DTensor's collectives counted on the
    first step, is what gloo's collectives were handed in that step (torch's profiler), sent
    by the ring algorithm, less the precision's one-element non-finite flag (4 bytes, all-reduced
    every step by layouts without DDP); and the steps after it hand gloo as much each."""
    job = make_job(["model=gpt", "data=text", "model.dim=32", "strategy=tp",
                    "checkpoint.every_steps=0", "eval.every_steps=0"], tmp_path)
    result = launch_ranks(measure_tp_wire, 2, "tp-wire", job)[0]
    first, next_two = (wire_bytes(handed, 2) for handed in result["handed"])
    flag = 2 * (2 - 1) / 2 * 4
    assert first > flag
    assert result["comm/bytes_per_step"] == pytest.approx(first - flag, rel=1e-12)
    assert next_two == pytest.approx(2 * first, rel=1e-12)
