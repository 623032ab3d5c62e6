"""What the planner knows of the machine: a compute rate per rank and a link per collective.

The links come from `task=commbench`, which saves its latency and peak bus bandwidth per op in a
per-machine cache (`save_links`); where no run of it is cached the planner uses a stated
default, and says so (`Machine.source`). The compute rate is measured here, by timing the
job's own model for a few forward and backward passes at a rank's batch (on CPU with the
thread count a worker gets, shared as the workers share the cores), so it includes what the
model's small kernels achieve rather than a data sheet's peak. On a GPU the parent takes the
data sheet's peak at an assumed utilisation instead (it must not hold a CUDA context).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mgpu.loss import cross_entropy
from mgpu.monitor.mfu import flops_per_sample, peak_flops
from mgpu.plan.speed import Link

#: A stated table for a machine commbench never ran on: gloo on one host's loopback, and
#: NVLink-class GPUs (bus bandwidth in bytes/s).
DEFAULT_LINKS = {
    "cpu": Link(latency_s=100e-6, busbw_Bps=1e9),
    "cuda": Link(latency_s=20e-6, busbw_Bps=100e9),
}
#: The ops the planner prices.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
TIMED_STEPS, WARMUP_STEPS = 5, 2
#: The share of a GPU's dense peak a small model's step reaches, where it is not timed.
ASSUMED_MFU = 0.4


@dataclass(frozen=True)
class Machine:
    flops_per_s: float
    links: dict[str, Link]
    #: Where the links came from: the cache file, or "default (...)".
    source: str
    #: What the ranks compute on: "cpu" where the host's memory is the device's too, so
    #: offloading to it frees nothing.
    device_type: str = "cpu"


def cache_dir() -> Path:
    """$MGPU_CACHE_DIR, else ~/.cache/mgpu."""
    return Path(os.environ.get("MGPU_CACHE_DIR") or Path.home() / ".cache" / "mgpu")


def links_file(device_type: str) -> Path:
    """One file per machine (host name) and device type."""
    return cache_dir() / f"commbench-{socket.gethostname()}-{device_type}.json"


def save_links(summary: dict[str, float], device_type: str) -> Path:
    """Cache a commbench summary (`commbench/<op>/latency_min_s`, `.../busbw_peak_GBps`)."""
    links = {}
    for op in OPS:
        latency = summary.get(f"commbench/{op}/latency_min_s")
        busbw = summary.get(f"commbench/{op}/busbw_peak_GBps")
        if latency is not None and busbw:
            links[op] = {"latency_s": latency, "busbw_Bps": busbw * 1e9}
    path = links_file(device_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(links, indent=1))
    return path


def load_links(device_type: str) -> tuple[dict[str, Link], str]:
    """The cached links of this machine, each missing op at the default; and their source."""
    default = DEFAULT_LINKS[device_type]
    path = links_file(device_type)
    if not path.exists():
        return dict.fromkeys(OPS, default), f"default ({default}; run task=commbench to measure)"
    cached = json.loads(path.read_text())
    links = {op: Link(**cached[op]) if op in cached else default for op in OPS}
    return links, str(path)


def measure_flops_rate(
    options: Any, flops_per_sample: float, batch: int, world_size: int, device: torch.device
) -> float:
    """FLOP/s one rank achieves on the job's model at `batch` samples per step: measured in
    this process, and on CPU scaled to the share of the cores each of `world_size` workers
    gets (as `limit_cpu_threads` sets them)."""
    data = options.data
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (cores or 1) // world_size))
    try:
        torch.manual_seed(0)
        model = options.model(input_shape=data.input_shape, num_classes=data.num_classes)
        model = model.to(device)
        dtype = torch.long if len(data.input_shape) == 1 else torch.float32
        high = data.num_classes if dtype == torch.long else 1
        inputs = torch.randint(0, high, (batch, *data.input_shape), device=device).to(dtype)
        seconds = timed_steps(model, inputs)
    finally:
        torch.set_num_threads(threads)
    rate = flops_per_sample * batch / seconds
    if device.type == "cpu":
        busy = world_size * max(1, (cores or 1) // world_size)
        rate *= min(1.0, (cores or 1) / busy)
    return rate


def timed_steps(model: torch.nn.Module, inputs: torch.Tensor) -> float:
    """Mean seconds of a forward, loss and backward pass, after warm-up."""
    def step() -> None:
        logits = model(inputs)
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=inputs.device)
        cross_entropy(logits, labels).backward()

    for _ in range(WARMUP_STEPS):
        step()
    sync(inputs.device)
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    sync(inputs.device)
    return (time.perf_counter() - start) / TIMED_STEPS


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_rate(device: torch.device, precision: Any) -> float | None:
    """A GPU's dense peak for the compute dtype at `ASSUMED_MFU`, or None where the peak
    table lacks it: timing the model here would hold a CUDA context in the parent for the
    whole run."""
    dtype = getattr(precision, "compute_dtype", precision.param_dtype)
    peak = peak_flops(torch.cuda.get_device_name(device), dtype,
                      torch.backends.cuda.matmul.allow_tf32)
    return peak * ASSUMED_MFU if peak is not None else None


def measure(options: Any, batch: int, world_size: int, device: torch.device) -> Machine:
    """This machine, as the planner sees it, for the job's model at a rank's `batch`."""
    links, source = load_links(device.type)
    data = options.data
    flops = flops_per_sample(options.model, data.input_shape, data.num_classes)
    rate = gpu_rate(device, options.precision) if device.type == "cuda" else None
    if rate is None:
        rate = measure_flops_rate(options, flops, batch, world_size, device)
    return Machine(rate, links, source, device.type)
