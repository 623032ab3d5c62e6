"""Monitoring: step-phase breakdown, comm bytes from the hook, exporter, trace, telemetry, MFU."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient

from mgpu.model.mlp import MLP
from mgpu.monitor.comm import CommMeter
from mgpu.monitor.mfu import MFU, flops_per_sample, peak_flops
from mgpu.monitor.prometheus import free_port
from mgpu.monitor.telemetry import CPU_KEYS, GPU_KEYS, Telemetry
from mgpu.monitor.timing import WallClock, in_flight_s
from mgpu.options import Options, build
from tests.conftest import QUICK, ROOT, assert_refused, launch_job, make_job, mlflow_runs
from tests.readme import prometheus_series

MLP_CFG = {"_target_": "mgpu.model.mlp.MLP", "hidden": [256, 256]}


def test_flop_count_of_the_mlp_matches_its_matmuls():
    """Forward 2·B·W, weight gradients 2·B·W, input gradients 2·B·W for all but the first
    layer (the data needs no gradient): W = the weight count of the three Linear layers."""
    layers = [(64, 256), (256, 256), (256, 10)]
    weights = sum(i * o for i, o in layers)
    expected = 2 * weights + 2 * weights + 2 * (weights - 64 * 256)
    assert flops_per_sample(functools.partial(build, MLP_CFG), (64,), 10) == expected


def test_peak_table_picks_dense_peaks_by_name_and_dtype():
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16, tf32=False) == 989e12
    assert peak_flops("NVIDIA H100 PCIe", torch.bfloat16, tf32=False) == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == 156e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=False) == 19.5e12
    assert peak_flops("NVIDIA L40S", torch.float16, tf32=False) == 362e12
    assert peak_flops("Some Unknown GPU", torch.bfloat16, tf32=False) is None


def test_no_mfu_on_cpu(tmp_path):
    options = Options.of(make_job([], tmp_path).groups())
    cpu = torch.device("cpu")
    assert MFU.for_run(options.model, options.data, cpu, options.precision, world_size=2) is None


class HalfPrecisionWire:
    """A compression of the test's own: DDP's fp16 hook, handed over as a compression would,
    with the declarations every compression option states."""

    needs_comm_hook = True
    stateful = False
    exact = False
    wire_dtype = None  # a hook of its own, not only a dtype

    def comm_hook(self, model: torch.nn.Module) -> tuple:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        return None, fp16_compress_hook

    def begin_step(self, grad_scale: torch.Tensor | None) -> None:
        pass

    def end_step(self, applied: bool) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_comm_timing_wraps_the_hook_handed_over_or_stands_in_for_ddps_all_reduce():
    """The hook keeps its state and is timed; with no hook, the timed stand-in for DDP's own
    all-reduce is what gets registered (so a monitored plain run reports comm time too)."""
    meter = CommMeter(torch.device("cpu"))

    def own_hook(state, bucket):
        raise AssertionError("not called here")

    state, timed = meter.timed(("group", own_hook))
    assert state == "group" and "own_hook" in timed.__qualname__
    state, timed = meter.timed(None)
    assert state is None and "allreduce_mean" in timed.__qualname__


@pytest.mark.dist
def test_comm_timing_wraps_the_hook_a_compression_registers(tmp_path):
    """The timed wrapper composes: the compression's hook runs (the weights differ from plain
    fp32 all-reduce) and a positive all-reduce time is reported. Bytes on the wire come from
    the compression: a compression that counts none claims none."""
    args = [*QUICK, "optim=sgd", "optim.lr=0.05", "monitor.enabled=true"]
    plain, plain_w = launch_job(args, tmp_path / "plain")
    half, half_w = launch_job(
        [*args, "compression._target_=tests.test_monitor.HalfPrecisionWire"], tmp_path / "half")
    assert any(not torch.equal(plain_w[k], half_w[k]) for k in plain_w)
    grad_bytes = sum(p.numel() * 4 for p in MLP((1, 8, 8), 10).parameters())
    assert plain["comm/bytes_per_step"] == grad_bytes  # ring all-reduce, 2 ranks: 2(2-1)/2 = 1
    assert plain["comm/bandwidth_GBps"] > 0
    assert "comm/bytes_per_step" not in half and "comm/bandwidth_GBps" not in half
    for summary in (plain, half):
        assert summary["comm/allreduce_s"] > 0


def test_allreduce_time_is_the_wall_time_some_bucket_is_in_flight():
    """Buckets queue behind each other, so their (launch, completion) intervals overlap: the
    step's communication time is the length of their union, not their sum."""
    seconds = WallClock().seconds
    # Two overlapping, one inside them, one after a gap; in launch order, as the hook sees them.
    intervals = [(10.0, 12.0), (10.5, 13.0), (11.0, 11.5), (14.0, 14.25)]
    assert in_flight_s(intervals, seconds) == 3.25  # [10, 13] and [14, 14.25]; their sum: 5.25
    assert in_flight_s([(1.0, 4.0), (2.0, 3.0)], seconds) == 3.0
    assert in_flight_s([], seconds) == 0.0


HOLD_S = 0.1  # how long each bucket stays in flight after its all-reduce
FORWARD_S = 0.025  # a forward pass that takes at least this long


class HeldAllReduce:
    """A compression of the test's own: each bucket is all-reduced plainly, and its future
    completes `HOLD_S` later, from a timer thread. So every bucket is in flight for at least
    `HOLD_S`, and a step's buckets are in flight together: their intervals overlap by
    construction. Counts its bytes on the wire (2 ranks: a ring all-reduce sends the bucket)."""

    needs_comm_hook = True
    stateful = False
    exact = True
    wire_dtype = None

    def __init__(self) -> None:
        self.bytes, self.steps = 0, 0

    def comm_hook(self, model: torch.nn.Module) -> tuple:
        def held(state, bucket):
            buffer = bucket.buffer().div_(dist.get_world_size())
            dist.all_reduce(buffer)
            self.bytes += buffer.numel() * buffer.element_size()
            future = torch.futures.Future()
            threading.Timer(HOLD_S, future.set_result, args=(buffer,)).start()
            return future

        return None, held

    def begin_step(self, grad_scale: torch.Tensor | None) -> None:
        pass

    def end_step(self, applied: bool) -> None:
        self.steps += 1

    def metrics(self) -> dict:
        per_step = self.bytes / self.steps
        self.bytes, self.steps = 0, 0
        return {"comm/bytes_per_step": per_step}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class SlowForwardMLP(MLP):
    """The MLP, with every training forward taking at least `FORWARD_S`: each step holds
    that much time outside communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(FORWARD_S)
        return super().forward(x)


@pytest.mark.dist
def test_allreduce_time_is_bounded_by_the_hold_and_the_step(tmp_path):
    """Buckets held in flight together for `HOLD_S` each: the logged all-reduce time is at
    least `HOLD_S` (some bucket is in flight that long) and at most the step time measured by
    the loop's own clock, which also holds a forward of `FORWARD_S` (added up per bucket it
    would be about `HOLD_S` times the number of buckets). The bandwidth divides the bytes by
    that time, so it lies between bytes per step time and bytes per `HOLD_S`."""
    summary, _ = launch_job(
        ["train.steps=8", "train.warmup_steps=4", "train.log_every=4", "eval.every_steps=0",
         "checkpoint.every_steps=0", "monitor.enabled=true", "model.hidden=[1024,1024]",
         "network.bucket_cap_mb=0.01", "model._target_=tests.test_monitor.SlowForwardMLP",
         "compression._target_=tests.test_monitor.HeldAllReduce"], tmp_path)
    # Steps 5-8: the last window (all-reduce time) and the timed steps (step time) agree.
    step_s = 64 / summary["train/samples_per_s"]
    assert HOLD_S <= summary["comm/allreduce_s"] <= step_s, (summary["comm/allreduce_s"], step_s)
    wire = summary["comm/bytes_per_step"]
    assert wire / step_s <= summary["comm/bandwidth_GBps"] * 1e9 <= wire / HOLD_S


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU driver")
def test_without_nvml_telemetry_reports_cpu_and_ram_and_does_not_crash():
    """A CUDA device whose NVML cannot start (no driver here): GPU figures absent, CPU present."""
    telemetry = Telemetry(torch.device("cuda", 0), interval_s=0.05)
    assert telemetry.gpu is None
    telemetry.start()
    time.sleep(0.3)
    values = dict(zip(telemetry.keys, telemetry.window(), strict=True))
    telemetry.stop()
    assert all(math.isnan(values[k]) for k in GPU_KEYS)
    assert all(math.isfinite(values[k]) for k in CPU_KEYS)
    assert values["cpu/rss_bytes"] > 10e6 and 0 < values["cpu/ram_used_ratio"] < 1


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["monitor.prometheus_port=80"], "monitor.prometheus_port"),
        (["monitor.interval_s=0"], "monitor.interval_s"),
        (["monitor.profile=true", "monitor.profile_start_step=1"], "monitor.profile_start_step"),
        (["monitor.profile=true", "train.steps=30", "train.warmup_steps=5",
          "monitor.profile_start_step=29"], "monitor.profile_start_step"),
    ],
)
def test_bad_monitor_settings_fail_before_launch(tmp_path, overrides, key):
    assert_refused(overrides, key, tmp_path)


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def samples_total(text: str | None, rank: int) -> float:
    for line in (text or "").splitlines():
        if line.startswith(f'mgpu_samples_total{{rank="{rank}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_workers_fork_from_a_server_that_has_not_imported_prometheus_client():
    """prometheus_client chooses multiprocess mode when first imported: the modules the fork
    server preloads must leave that import to the exporter, after it has set the directory."""
    code = ("import sys, mgpu.launch, mgpu.worker, mgpu.task.train; "
            "print('prometheus_client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


EXPORTER_STEPS = """
import sys, urllib.request
from pathlib import Path
import torch
from mgpu.job import MonitorConf
from mgpu.monitor import Monitor
from mgpu.runtime import Runtime

out, port = Path(sys.argv[1]), int(sys.argv[2])
runtime = Runtime(0, 0, 1, 1, torch.device("cpu"), out)
monitor = Monitor(MonitorConf(prometheus_port=port), runtime, None, "", warmup_steps=0,
                  mfu=None)
for step, samples in enumerate([32, 32, 40, 45], start=1):  # the split changed after step 2
    monitor.end_step(step, samples)
monitor.log_point(4, {}, 0.01)
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
monitor.close()
"""


def test_exporter_counts_the_samples_each_step_took_after_the_split_changes(tmp_path):
    """A rank that took 32, 32, 40 and 45 samples (a balance moved work to it after step 2)
    has taken 149, not 4 x its first share of 32. In a process of its own: the exporter sets
    prometheus_client's multiprocess mode, which must not leak into the test process."""
    port = free_port()
    page = subprocess.run([sys.executable, "-c", EXPORTER_STEPS, str(tmp_path), str(port)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert page.returncode == 0, page.stderr[-3000:]
    assert samples_total(page.stdout, 0) == 149


@pytest.mark.e2e
@pytest.mark.timing
def test_monitored_run_breaks_down_steps_times_comm_serves_prometheus_and_traces(tmp_path):
    """One 2-rank DDP run with everything on; the node's exporter is scraped while it trains."""
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    args = ["train.steps=400", "train.warmup_steps=20", "train.log_every=50",
            "eval.every_steps=0", "monitor.enabled=true", "monitor.interval_s=0.5",
            f"monitor.prometheus_port={port}", "monitor.profile=true",
            "monitor.profile_start_step=10", "monitor.profile_steps=3",
            "tracking.system_metrics=true"]
    proc = subprocess.Popen([sys.executable, "-m", "mgpu", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pages: dict[int, str] = {}
    second_port = "not scraped"
    for _ in range(2400):  # bounded: at most ~2 minutes of polling, one request each
        text = scrape(port)
        for rank in (0, 1):
            if samples_total(text, rank) > 0:
                pages.setdefault(rank, text)
        if len(pages) == 2:
            second_port = scrape(port + 1)  # while the run still serves
        if len(pages) == 2 or proc.poll() is not None:
            break
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]

    # Prometheus: one port served both ranks' live series with their rank label, on loopback.
    assert set(pages) == {0, 1}, "the exporter never answered with samples during the run"
    assert second_port is None, "local rank 1 served a port of its own"
    for rank, text in pages.items():
        for name in ("mgpu_step_duration_seconds", "mgpu_phase_duration_seconds",
                     "mgpu_allreduce_duration_seconds", "mgpu_comm_bytes_total", "mgpu_loss"):
            assert f'{name}{{' in text and f'rank="{rank}"' in text, name
        assert samples_total(text, rank) % 32 == 0  # whole local batches of 64 / 2 ranks

    [run] = mlflow_runs(tmp_path)
    metrics = run.data.metrics
    # The breakdown sums to the step time: the phases are disjoint intervals of each step, so
    # their sum is at most the step; the remainder (loop, loss bookkeeping, log points) < 15 %.
    step_mean_s = 64 / metrics["train/samples_per_s"]
    phases_s = sum(metrics[f"time/{p}_mean_s"] for p in ("data", "forward", "backward",
                                                           "optimizer"))
    assert 0.85 * step_mean_s < phases_s <= step_mean_s * 1.0001, (phases_s, step_mean_s)
    for phase in ("data", "forward", "backward", "optimizer"):
        p50, p90, p99 = (metrics[f"time/{phase}_{q}_s"] for q in ("p50", "p90", "p99"))
        assert 0 < p50 <= p90 <= p99
    # Bytes on the wire = the model's gradient bytes (fp32, ring all-reduce over 2 ranks).
    grad_bytes = sum(p.numel() * 4 for p in MLP((1, 8, 8), 10).parameters())
    assert metrics["comm/bytes_per_step"] == grad_bytes
    assert metrics["comm/allreduce_s"] > 0 and metrics["comm/bandwidth_GBps"] > 0
    assert metrics["time/slowest_rank"] in (0, 1)
    assert metrics["time/compute_before_comm_max_s"] >= metrics["time/compute_before_comm_min_s"]
    # Telemetry without NVML: CPU and RAM across ranks, no GPU figures, no MFU on CPU.
    assert metrics["cpu/rss_bytes_min"] <= metrics["cpu/rss_bytes_mean"] <= metrics[
        "cpu/rss_bytes_max"]
    assert not [k for k in metrics if k.startswith("gpu/")] and "train/mfu" not in metrics
    assert [k for k in metrics if k.startswith("system/")], "MLflow system metrics missing"

    # The profiler's Chrome trace of every rank is an artifact of the run, phases labelled.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "profile")}
    assert artifacts == {"profile/trace_rank0.json", "profile/trace_rank1.json"}
    trace = Path(run.data.tags["mgpu.output_dir"], "profile", "trace_rank0.json")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"forward", "backward", "optimizer"} <= names


@pytest.mark.gpu
@pytest.mark.e2e
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_events_nvml_and_mfu(cli, tmp_path):
    """On GPUs: phases from CUDA events still sum to the step, NVML figures and MFU appear."""
    result = cli("train.steps=200", "train.warmup_steps=20", "train.log_every=50",
                 "eval.every_steps=0", "monitor.enabled=true", "monitor.interval_s=0.2")
    assert result.returncode == 0, result.stderr
    [run] = mlflow_runs(tmp_path)
    metrics = run.data.metrics
    step_mean_s = 64 / metrics["train/samples_per_s"]
    phases_s = sum(metrics[f"time/{p}_mean_s"] for p in ("data", "forward", "backward",
                                                           "optimizer"))
    assert 0.5 * step_mean_s < phases_s < 1.1 * step_mean_s, (phases_s, step_mean_s)
    assert 0 < metrics["train/mfu"] < 1
    assert metrics["gpu/memory_used_bytes_max"] > 0 and metrics["gpu/power_w_mean"] > 0
    gpus = torch.cuda.device_count()
    if gpus > 1:  # ring all-reduce: 2(W-1)/W of the gradient bytes from each rank
        grad_bytes = sum(p.numel() * 4 for p in MLP((1, 8, 8), 10).parameters())
        assert metrics["comm/bytes_per_step"] == 2 * (gpus - 1) / gpus * grad_bytes


def served_series(text: str | None) -> set[str]:
    """The names of the `mgpu_` series a /metrics page holds samples of."""
    lines = (text or "").splitlines()
    return {re.split(r"[{ ]", line)[0] for line in lines if line.startswith("mgpu_")}


@pytest.mark.e2e
def test_the_port_alone_serves_every_series_the_readme_lists(tmp_path):
    """`python -m mgpu monitor.prometheus_port=9400`, as the README shows it, fills the
    dashboard: every series the README lists is served while the run trains (on a machine
    without NVML all but the `mgpu_gpu_*` ones), and no series it leaves out."""
    listed = prometheus_series()
    assert len(listed) >= 10, listed
    expected = {name for name in listed if not name.startswith("mgpu_gpu_")}
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    args = [f"monitor.prometheus_port={port}", "monitor.interval_s=0.5", "train.steps=600",
            "train.warmup_steps=5", "train.log_every=10", "eval.every_steps=0",
            "checkpoint.every_steps=0", "tracking.enabled=false"]
    proc = subprocess.Popen([sys.executable, "-m", "mgpu", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    served: set[str] = set()
    while proc.poll() is None and not expected <= served:
        served |= served_series(scrape(port))
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert served == expected, (f"listed but not served: {sorted(expected - served)}; "
                                f"served but not listed: {sorted(served - expected)}")
