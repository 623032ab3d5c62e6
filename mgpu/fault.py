"""Fault injection for tests and demos: fail one rank at one step, on the first attempt only.

`nonfinite_grad` fails nothing: it puts an inf into one gradient, which the precision skips.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from mgpu.config import FaultConf

log = logging.getLogger("mgpu.fault")


def fault_step(fault: FaultConf, rank: int) -> int | None:
    """The step at which this rank fails, or None. Restarted attempts run clean unless
    `every_attempt` is set."""
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    if fault.mode and rank == fault.kill_rank and (first_attempt or fault.every_attempt):
        return fault.at_step
    return None


def inject(mode: str, rank: int, step: int, model: nn.Module | None = None) -> None:
    log.warning("injecting fault.mode=%s on rank %d at step %d", mode, rank, step)
    if mode == "nonfinite_grad":
        poison_next_gradient(model)
        return
    if mode == "hang":  # stop here for good, as a rank stuck outside any collective would
        threading.Event().wait()
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
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
    """The step this rank is at, kept in an 8-byte memory-mapped file (`step_file`).

    A rank killed by a signal (SIGKILL, the OOM killer) leaves no error report; the file is
    where its launcher reads the step it died at. A write to mapped memory per step costs no
    system call.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(8))
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), 8)
        self._step = 0

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step = step
        struct.pack_into("<q", self._map, 0, step)


def read_step(path: Path) -> int | None:
    """The step a rank's `StepMark` last recorded, or None where it never wrote one."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return struct.unpack("<q", data)[0] if len(data) == 8 else None


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
