"""The switch triggers that read what the run measures: `switch.when.loss_plateau` and
`switch.when.throughput_drop`, decided at log points.

No rank may switch alone: the others would wait in the next step's collectives for it. Each
rank therefore decides from the same figures: the log point's train/loss and step time, made
identical on every rank by one all-reduce (MAX: exact, so every rank gets the same bits), and
the same rule on them gives the same answer everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mgpu.job import SwitchWhen

log = logging.getLogger("mgpu.switch")


@dataclass(frozen=True)
class Point:
    """One log point of this process, as every rank holds it."""

    step: int
    steps: int  # the training steps it covers: since the previous log point (or the resume)
    loss: float  # train/loss: the mean loss per sample over those steps, all ranks
    seconds: float  # their wall time, stalls left out (the slowest rank's)


def window(points: list[Point], end: int, length: int) -> list[Point] | None:
    """The points of the `length` steps that end at step `end`, or None where this process
    did not log all of those steps (the window starts before it did)."""
    inside = [p for p in points if end - length < p.step <= end]
    return inside if sum(p.steps for p in inside) == length else None


def mean_loss(points: list[Point]) -> float:
    """The mean train loss of the points' steps (each point weighs by the steps it covers)."""
    return sum(p.loss * p.steps for p in points) / sum(p.steps for p in points)


def improvement(points: list[Point], end: int, length: int) -> float | None:
    """How much the mean loss of the `length` steps up to `end` fell below that of the
    `length` steps before them, relative to the earlier; None until both were logged."""
    now, before = window(points, end, length), window(points, end - length, length)
    if now is None or before is None:
        return None
    earlier = mean_loss(before)
    return (earlier - mean_loss(now)) / abs(earlier) if earlier else 0.0


def samples_per_s(points: list[Point], end: int, length: int, global_batch: int) -> float | None:
    """Samples/s over the `length` steps up to `end`; None until they were all logged."""
    now = window(points, end, length)
    if now is None:
        return None
    return global_batch * length / sum(p.seconds * p.steps for p in now)


class Triggers:
    """The measured triggers of one process's part of the run: `fires` at each log point."""

    def __init__(self, when: SwitchWhen, start_step: int, global_batch: int) -> None:
        self.plateau, self.drop = when.loss_plateau, when.throughput_drop
        self.global_batch = global_batch
        self.points: list[Point] = []
        self.last_step = start_step
        self.best = 0.0  # the best window's samples/s so far

    @property
    def measuring(self) -> bool:
        return bool(self.plateau.window or self.drop.window)

    def fires(self, step: int, loss: float, step_s: float) -> bool:
        """Whether the run switches after `step`, a log point; every rank must call it (one
        small all-reduce where a measured trigger is set) and gets the same answer."""
        if not self.measuring:
            return False
        agreed = torch.tensor([loss, step_s], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        loss, step_s = agreed.tolist()
        steps = step - self.last_step
        self.last_step = step
        self.points.append(Point(step, steps, loss, step_s))
        kept = 2 * max(self.plateau.window, self.drop.window)
        self.points = [p for p in self.points if p.step > step - kept]
        return self.plateaued(step) or self.dropped(step)

    def plateaued(self, step: int) -> bool:
        if not self.plateau.window:
            return False
        fell = improvement(self.points, step, self.plateau.window)
        if fell is None or fell >= self.plateau.threshold:
            return False
        log.info("switch.when.loss_plateau: train/loss fell %.3g%% over the last %d steps, "
                 "under threshold=%g: switching after step %d", 100 * fell,
                 self.plateau.window, self.plateau.threshold, step)
        return True

    def dropped(self, step: int) -> bool:
        if not self.drop.window:
            return False
        rate = samples_per_s(self.points, step, self.drop.window, self.global_batch)
        if rate is None:
            return False
        self.best = max(self.best, rate)
        if rate >= self.drop.fraction * self.best:
            return False
        log.info("switch.when.throughput_drop: %.0f samples/s over the last %d steps, under "
                 "fraction=%g of the best window's %.0f: switching after step %d", rate,
                 self.drop.window, self.drop.fraction, self.best, step)
        return True
