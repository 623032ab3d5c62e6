"""Fault injection for tests and demos: fail one rank at one step, on the first attempt only."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

log = logging.getLogger("mgpu.fault")


def fault_step(fault: dict, rank: int) -> int | None:
    """The step at which this rank fails, or None. Restarted attempts run clean unless
    `every_attempt` is set."""
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    if fault["mode"] and rank == fault["kill_rank"] and (first_attempt or fault["every_attempt"]):
        return fault["at_step"]
    return None


def inject(mode: str, rank: int, step: int) -> None:
    log.warning("injecting fault.mode=%s on rank %d at step %d", mode, rank, step)
    if mode == "hang":  # stop here for good, as a rank stuck outside any collective would
        threading.Event().wait()
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault (fault.mode={mode}) on rank {rank} at step {step}")


@contextmanager
def naming_step() -> Iterator[SimpleNamespace]:
    """Errors escaping the training loop name the step they happened at (set `.step`).

    A rank whose peer hangs fails with a collective timeout that says nothing about where;
    with the step in the message the user's one-line summary says where the group stopped.
    """
    at = SimpleNamespace(step=0)
    try:
        yield at
    except Exception as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()] or [""]
        raise RuntimeError(f"at step {at.step}: {type(e).__name__}: {lines[-1]}") from e
