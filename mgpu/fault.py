"""Fault injection for tests, demos and the chaos bench.

`fault.mode` fails one rank at one step, on the first attempt only (`every_attempt`: on every
one). `nonfinite_grad` fails nothing: it puts an inf into one gradient, which the precision
skips. `fault.schedule` spreads `count` faults of mixed kinds over one run, at seeded random
steps and ranks; restart attempt k fires the k-th (by step), so each fires once however many
restarts came before it. `checkpoint_sigkill` kills its rank while it writes the checkpoint
of its step: its shards are on disk, the checkpoint is never committed. `oom` raises what a
device that ran out of memory raises (`torch.OutOfMemoryError`).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import random
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

if TYPE_CHECKING:
    from mgpu.job import FaultConf, FaultSchedule

log = logging.getLogger("mgpu.fault")

#: The scheduled kind that fires inside a checkpoint save rather than at the start of a step.
IN_CHECKPOINT = "checkpoint_sigkill"


@dataclass(frozen=True)
class Fault:
    """One injected failure: `mode` on rank `rank` at step `step`."""

    step: int
    rank: int
    mode: str


def drawn(
    schedule: FaultSchedule, steps: int, checkpoint_every: int, world_size: int
) -> list[Fault]:
    """`fault.schedule`'s faults in the order they fire (by step), the same on every rank and
    attempt: the i-th of `count` is of kind kinds[i % len(kinds)], at a step of its own drawn
    from 1..steps (a checkpoint step for checkpoint_sigkill), on a drawn rank.

    Distinct increasing steps make attempt k reach fault k: it resumes from a checkpoint
    before fault k-1's step, which is before fault k's. The checkpoint kinds draw first, from
    the fewer steps they may take.
    """
    rng = random.Random(schedule.seed)
    kinds = [schedule.kinds[i % len(schedule.kinds)] for i in range(schedule.count)]
    free = set(range(1, steps + 1))
    saves = set(range(checkpoint_every, steps + 1, checkpoint_every)) if checkpoint_every else set()
    faults = []
    for kind in sorted(kinds, key=lambda kind: kind != IN_CHECKPOINT):
        step = rng.choice(sorted(free & saves if kind == IN_CHECKPOINT else free))
        free.discard(step)
        faults.append(Fault(step, rng.randrange(world_size), kind))
    return sorted(faults, key=lambda fault: fault.step)


def this_attempt(
    fault: FaultConf, steps: int, checkpoint_every: int, world_size: int, rank: int
) -> Fault | None:
    """The fault this rank injects in this attempt of the worker group, or None.

    `fault.mode`: on the first attempt only, unless `every_attempt`. `fault.schedule`: attempt
    k (the launcher's restart count) fires the k-th fault, so those before it, which caused
    the k restarts so far, do not fire again.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if fault.mode:
        if rank == fault.kill_rank and (attempt == 0 or fault.every_attempt):
            return Fault(fault.at_step, rank, fault.mode)
        return None
    faults = drawn(fault.schedule, steps, checkpoint_every, world_size)
    if attempt < len(faults) and faults[attempt].rank == rank:
        return faults[attempt]
    return None


def checkpoint_writer(fault: Fault | None, step: int) -> Callable[[Path], FileSystemWriter]:
    """The storage writer of the checkpoint at `step`, given its folder: DCP's own, or one that
    kills this rank once its shards are written, where a checkpoint_sigkill fault is due."""
    if fault is not None and fault.mode == IN_CHECKPOINT and fault.step == step:
        return functools.partial(KilledAfterWriting, fault=fault)
    return FileSystemWriter


class KilledAfterWriting(FileSystemWriter):
    """DCP's file writer that SIGKILLs its process once this rank's shards are on disk: a rank
    lost in the middle of a checkpoint save (no `.metadata`, never committed), while its peers
    wait for it in the save's last collective."""

    def __init__(self, path: Path, fault: Fault) -> None:
        super().__init__(path)
        self.fault = fault

    def write_data(self, plan, planner):  # noqa: ANN001, ANN201  (DCP's signature)
        written = super().write_data(plan, planner)
        written.wait()
        log.warning("injecting fault.mode=%s on rank %d at step %d (its shards written)",
                    self.fault.mode, self.fault.rank, self.fault.step)
        os.kill(os.getpid(), signal.SIGKILL)
        return written


def inject(mode: str, rank: int, step: int, model: nn.Module | None = None) -> None:
    log.warning("injecting fault.mode=%s on rank %d at step %d", mode, rank, step)
    if mode == "nonfinite_grad":
        poison_next_gradient(model)
        return
    if mode == "hang":  # stop here for good, as a rank stuck outside any collective would
        threading.Event().wait()
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "oom":
        raise torch.OutOfMemoryError(f"injected fault (fault.mode=oom) on rank {rank} at step "
                                     f"{step}")
    raise RuntimeError(f"injected fault (fault.mode={mode}) on rank {rank} at step {step}")


def poison_next_gradient(model: nn.Module) -> None:
    """Make the next gradient of the model's first parameter +inf on this rank, once.

    A tensor hook runs as the gradient is computed, before DDP's all-reduce sees it: the same
    place a real overflow would appear.
    """
    param = next(model.parameters())

    def to_inf(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        return torch.full_like(grad, float("inf"))

    handle = param.register_hook(to_inf)


def step_file(output_dir: str | Path, rank: int) -> Path:
    """Where a rank keeps the step it is at (`StepMark`)."""
    return Path(output_dir, "logs", f"rank{rank}.step")


class StepMark:
    """The step this rank is at, and the last step it completed with the wall time it did, kept
    in a 24-byte memory-mapped file (`step_file`).

    A rank killed by a signal (SIGKILL, the OOM killer) leaves no error report; the file is
    where its launcher reads the step it died at, and where the next worker group of an
    elastic job reads when the job last made progress (`mgpu.elastic`). A write to mapped
    memory per step costs no system call.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(MARK_BYTES))
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), MARK_BYTES)
        self._step = 0

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step = step
        struct.pack_into("<q", self._map, 0, step)

    def completed(self, step: int) -> None:
        """`step` is done, now."""
        struct.pack_into("<qd", self._map, 8, step, time.time())


MARK_BYTES = 24  # the step at, the last step completed, the wall time it completed at


def read_step(path: Path) -> int | None:
    """The step a rank's `StepMark` last recorded, or None where it never wrote one."""
    data = _read_mark(path)
    return struct.unpack_from("<q", data)[0] if data else None


def read_completed(path: Path) -> tuple[int, float] | None:
    """(the last step a rank's `StepMark` recorded as completed, its wall time), or None where
    it completed none."""
    data = _read_mark(path)
    step, at = struct.unpack_from("<qd", data, 8) if data else (0, 0.0)
    return (step, at) if step else None


def _read_mark(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if len(data) == MARK_BYTES else None


@contextmanager
def naming_step(output_dir: str | Path, rank: int) -> Iterator[StepMark]:
    """Errors escaping the training loop name the step they happened at (set `.step`), and a
    rank killed without a word leaves its step in `step_file`.

    A rank whose peer hangs fails with a collective timeout that says nothing about where;
    with the step in the message the user's one-line summary says where the group stopped.
    """
    at = StepMark(step_file(output_dir, rank))
    try:
        yield at
    except Exception as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()] or [""]
        raise RuntimeError(f"at step {at.step}: {type(e).__name__}: {lines[-1]}") from e
