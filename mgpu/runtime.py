"""Per-rank runtime: logging, threads, device and the process group, set up once per worker."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mgpu.elastic import Membership

log = logging.getLogger("mgpu")


@dataclass(frozen=True)
class Runtime:
    """Where this rank sits in the job and what it computes on."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    output_dir: Path
    # Where a job run by global rank 0 (multi-node, elastic) has its groups: this one's place.
    membership: Membership | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def gather_rows(values: list[float], runtime: Runtime) -> torch.Tensor:
    """Every rank's `values` as one (world size x len(values)) float64 tensor, on every rank.

    An all-reduce of a zero matrix holding this rank's row: x + 0 is exact, so all ranks see
    bitwise the same numbers and make the same decisions from them.
    """
    rows = torch.zeros(runtime.world_size, len(values), dtype=torch.float64, device=runtime.device)
    rows[runtime.rank] = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(rows)
    return rows.cpu()


def setup_logging(rank: int, output_dir: Path) -> None:
    """Rank-prefixed log lines: all of them in `logs/rank{r}.log`, rank 0's INFO on the console.

    Spawned workers start with no handlers, so without this their logging output is lost.
    """
    log_dir = output_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file = logging.FileHandler(log_dir / f"rank{rank}.log")
    to_file.setFormatter(fmt)
    to_console = logging.StreamHandler()
    to_console.setFormatter(fmt)
    to_console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root = logging.getLogger()
    root.handlers[:] = [to_file, to_console]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def pick_device(local_rank: int) -> torch.device:
    """One GPU per local rank where CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def limit_cpu_threads(local_world_size: int) -> None:
    """Keep workers x threads <= cores: oversubscribed CPU ranks slow each other down."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // local_world_size))


def process_group_backend(device: torch.device) -> str:
    """The backend for every tensor a collective may hold: gloo for CPU tensors, and on CUDA
    nccl for CUDA tensors beside it.

    Small figures (memory, timings, pickled objects) travel as CPU tensors on every device; a
    group with nccl alone has no backend for them. `init_process_group` gets no `device_id`:
    with a bound device, a DeviceMesh of more than one dim makes its sub-groups by
    `split_group`, which in torch 2.6 and several releases after fails for any backend but
    plain "nccl" (pytorch issue #159200); unbound, it makes them by `new_group`, which
    inherits both backends, and nccl connects on first use on the device `pick_device` set.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_runtime(output_dir: str, timeout_s: int) -> Runtime:
    """Join the process group that the launcher (elastic agent or torchrun) describes in env,
    logging into `output_dir/logs`."""
    setup_logging(int(os.environ.get("RANK", 0)), Path(output_dir))
    return join_group(output_dir, timeout_s)


def join_group(output_dir: str, timeout_s: int) -> Runtime:
    """Join the process group that the launcher describes in env; logging is the caller's
    (`setup_logging`): a job that rank 0 hands to the others logs once it is known."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    limit_cpu_threads(local_world_size)
    device = pick_device(local_rank)
    if world_size > 1 or "MASTER_ADDR" in os.environ:
        dist.init_process_group(
            backend=process_group_backend(device), timeout=timedelta(seconds=timeout_s)
        )
    return Runtime(rank, local_rank, world_size, local_world_size, device, Path(output_dir))


def shutdown() -> None:
    """Leave the process group; never a collective, so it cannot hang on a failed peer.

    Call it after the run (model, optimizer) is released. A DDP reducer that outlives the
    group holds its last reference, and freeing it then joins gloo's worker threads while
    holding the GIL, which a worker thread freeing a finished collective's tensors waits for:
    the rank hangs for ever. Collecting first frees wrappers kept only by reference cycles
    while the group is still registered, so the group itself is freed last, without the GIL.
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
