"""Fault injection for tests and demos: fail one rank at one step, on the first attempt only."""

from __future__ import annotations

import os
import signal


def fault_step(fault: dict, rank: int) -> int | None:
    """The step at which this rank fails, or None. Restarted attempts run clean."""
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    if fault["mode"] and rank == fault["kill_rank"] and first_attempt:
        return fault["at_step"]
    return None


def inject(mode: str, rank: int, step: int) -> None:
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault (fault.mode={mode}) on rank {rank} at step {step}")
