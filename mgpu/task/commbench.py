"""Collective benchmark: latency and bandwidth of the backend's collectives over message sizes.

Figures follow nccl-tests (its PERFORMANCE.md): the message size S is the full buffer (for
all_gather the gathered output, for reduce_scatter the input), algbw = S / time, and busbw =
algbw x a factor for what each rank's link must carry, so busbw compares across world sizes
and against the hardware's peak: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n,
broadcast 1.
"""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mgpu.errors import ConfigError
from mgpu.plan.machine import save_links
from mgpu.runtime import Runtime
from mgpu.tracking import MetricLogger, Spool, record

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

log = logging.getLogger(__name__)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
ELEMENT_BYTES = 4  # float32, as nccl-tests by default
TABLE_FILE = "commbench.csv"
# torch 2.13 renamed the tensor variants; older releases (>= 2.6) have only the old names.
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for `op` on `world_size` ranks (nccl-tests' definitions)."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # broadcast


@dataclass(frozen=True)
class Result:
    op: str
    size_bytes: int
    latency_s: float
    algbw_GBps: float  # units in the name, as logged
    busbw_GBps: float


def result(op: str, size_bytes: int, seconds: float, world_size: int) -> Result:
    """One measurement as latency, algorithm bandwidth and bus bandwidth (GB = 1e9 bytes)."""
    algbw = size_bytes / seconds / 1e9
    return Result(op, size_bytes, seconds, algbw, algbw * bus_factor(op, world_size))


def message_sizes(min_bytes: int, max_bytes: int, factor: int, world_size: int) -> list[int]:
    """min, min x factor, ... up to max, each rounded down to whole float32 elements per rank."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        chunk = ELEMENT_BYTES * world_size
        aligned = max(size // chunk, 1) * chunk
        if not sizes or aligned > sizes[-1]:
            sizes.append(aligned)
        size *= factor
    return sizes


class CommBench:
    outputs = (TABLE_FILE, "summary.json", "logs/")

    def __init__(
        self,
        ops: list[str] = OPS,
        min_bytes: int = 1024,
        max_bytes: int = 256 * 2**20,
        factor: int = 2,
        warmup: int = 5,
        repeats: int = 20,
    ) -> None:
        unknown = [op for op in ops if op not in OPS]
        if not ops or unknown:
            raise ConfigError(f"task.ops={list(ops)}: choose from {', '.join(OPS)}")
        if min_bytes <= 0:
            raise ConfigError(f"task.min_bytes={min_bytes}: must be > 0")
        if min_bytes > max_bytes:
            raise ConfigError(f"task.min_bytes={min_bytes}: must be <= task.max_bytes={max_bytes}")
        if factor < 2:
            raise ConfigError(f"task.factor={factor}: must be >= 2")
        if warmup < 0 or repeats < 1:
            raise ConfigError(f"task.warmup={warmup}, task.repeats={repeats}: need >= 0 and >= 1")
        self.ops = list(ops)
        self.min_bytes, self.max_bytes, self.factor = min_bytes, max_bytes, factor
        self.warmup, self.repeats = warmup, repeats
        self.objective = f"commbench/{self.ops[0]}/busbw_peak_GBps"

    def run(
        self, job: Job, options: Options, runtime: Runtime, run_id: str | None
    ) -> dict[str, float]:
        """Every op at every size; rank 0 logs each point (step = size in bytes) and the table."""
        tracker = (MetricLogger(job.tracking.uri, run_id, job.output_dir)
                   if runtime.is_main and run_id else None)
        sizes = message_sizes(self.min_bytes, self.max_bytes, self.factor, runtime.world_size)
        log.info("commbench: %s on %d rank(s), %d to %d bytes", ", ".join(self.ops),
                 runtime.world_size, sizes[0], sizes[-1])
        results = []
        for op in self.ops:
            for size in sizes:
                res = result(op, size, self.seconds_per_call(op, size, runtime), runtime.world_size)
                log.info("%-14s %12d B %10.1f us %8.3f GB/s algbw %8.3f GB/s busbw", op, size,
                         res.latency_s * 1e6, res.algbw_GBps, res.busbw_GBps)
                results.append(res)
                if tracker:
                    tracker.log({f"commbench/{op}/{name}": getattr(res, name)
                                 for name in ("latency_s", "algbw_GBps", "busbw_GBps")}, size)
        summary = summarize(results)
        if runtime.is_main:
            save_links(summary, runtime.device.type)  # this machine's table, for the planner
            path = write_table(results, runtime.output_dir / TABLE_FILE)
            if tracker:
                tracker.log(summary, 0)
                tracker.close()
                Spool(job.output_dir).deliver(
                    [record(job.tracking.uri, run_id, artifact=str(path))])
        return summary

    def seconds_per_call(self, op: str, size_bytes: int, runtime: Runtime) -> float:
        """Mean time of one call over `repeats` back-to-back calls, on the slowest rank."""
        call = checked_collective(op, size_bytes // ELEMENT_BYTES, runtime)
        for _ in range(self.warmup):
            call()
        synchronize(runtime.device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(self.repeats):
            call()
        synchronize(runtime.device)
        seconds = (time.perf_counter() - start) / self.repeats
        elapsed = torch.tensor([seconds], device=runtime.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective ends with its last rank
        return elapsed.item()

    def summary_line(self, summary: dict[str, float]) -> str:
        peaks = (f"{op} {summary[f'commbench/{op}/busbw_peak_GBps']:.3f}" for op in self.ops)
        return f"commbench peak busbw (GB/s): {', '.join(peaks)}"


def checked_collective(op: str, numel: int, runtime: Runtime) -> Callable[[], object]:
    """The collective on fresh buffers, after one call whose result is checked.

    Each rank starts with its rank + 1 in every element, so every op has a known answer; the
    input is then zeroed so repeated in-place reductions stay finite.
    """
    n, rank, device = runtime.world_size, runtime.rank, runtime.device
    chunk = numel // n
    mine = float(rank + 1)
    total = float(n * (n + 1) // 2)
    if op == "all_reduce":
        data = out = torch.full((numel,), mine, device=device)
        expected = torch.full((numel,), total, device=device)
        call = partial(dist.all_reduce, data)
    elif op == "all_gather":
        data, out = torch.full((chunk,), mine, device=device), torch.empty(numel, device=device)
        expected = torch.arange(1, n + 1, device=device, dtype=out.dtype).repeat_interleave(chunk)
        call = partial(ALL_GATHER, out, data)
    elif op == "reduce_scatter":
        data, out = torch.full((numel,), mine, device=device), torch.empty(chunk, device=device)
        expected = torch.full((chunk,), total, device=device)
        call = partial(REDUCE_SCATTER, out, data)
    else:
        data = out = torch.full((numel,), mine, device=device)
        expected = torch.ones(numel, device=device)
        call = partial(dist.broadcast, data, src=0)
    call()
    if not torch.equal(out, expected):
        raise RuntimeError(f"commbench: {op} of {numel * ELEMENT_BYTES} B gave wrong results "
                           f"on rank {rank}")
    data.zero_()
    return call


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(results: list[Result]) -> dict[str, float]:
    """Per op: the peak bus bandwidth and the lowest latency (usually the smallest message)."""
    summary = {}
    for op in dict.fromkeys(r.op for r in results):
        mine = [r for r in results if r.op == op]
        summary[f"commbench/{op}/busbw_peak_GBps"] = max(r.busbw_GBps for r in mine)
        summary[f"commbench/{op}/latency_min_s"] = min(r.latency_s for r in mine)
    return summary


def write_table(results: list[Result], path: Path) -> Path:
    """All measurements as CSV (the MLflow UI shows it as a table)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)
    return path
