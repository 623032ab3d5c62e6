"""Throughput split: faster ranks take more of the (fixed) global batch, so all finish together.

Each rank measures its own work per step (forward + backward up to its last local gradient,
excluding the wait for peers: see `clock.py`) and takes the median step of a window. After
`warmup_steps` steps, and then every `rebalance_every` steps, the ranks all-gather these
medians, and every rank adds them to the same per-rank history of (local batch size, seconds)
and fits each rank's step time as a fixed cost plus a cost per sample (`steptime.py`), the
sizes measured longer ago weighing less (`ema`). The split is then the one whose slowest rank
is predicted to finish first, with no share more than doubled or halved at once (the line is
trusted near the sizes it was fitted on). It is applied only if that is predicted to shorten
the slowest rank's time by more than `hysteresis` (a fraction), so measurement noise does not
make the sizes oscillate, and equal ranks keep the equal split.

With no fixed cost this is the proportional split; at small batches, where the fixed part is
much of a step, the proportional split of measured samples/s moves too little work at once
and, smoothed across splits, the wrong amount: the fitted line knows what one more sample costs.

A checkpoint holds the split, the history of every rank's measurements, the step count (the
rebalancing schedule) and the number of rebalancings, so a resumed run fits and splits as the
uninterrupted one would; at another world size it starts from an equal split, said in one log
line.

The update stays exact: each micro-batch's loss is weighted by its share of the global batch
(`loss_divisor`), and the ranks' shares of a step are consecutive slices of the global batch a
single process would take (`mgpu/data/sampler.py`), so the update equals the single-process one.
"""

from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING

import torch

from mgpu.balance.equal import EqualSplit
from mgpu.balance.steptime import (
    History,
    StepTime,
    fit,
    next_split,
    remember,
    slowest_s,
)
from mgpu.errors import ConfigError
from mgpu.runtime import gather_rows

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

log = logging.getLogger(__name__)


def describe(models: list[StepTime]) -> str:
    """The fitted step times for a log line."""
    if not models:
        return "no step times fitted yet"
    return "ms fixed + per sample, per rank: " + ", ".join(
        f"{1e3 * m.fixed_s:.3g} + {1e3 * m.per_sample_s:.3g}" for m in models)


class Throughput(EqualSplit):
    uneven = True
    measures = True
    stateful = True
    deterministic = False  # the split follows measured step times

    def __init__(
        self,
        warmup_steps: int = 10,
        rebalance_every: int = 25,
        ema: float = 0.5,
        hysteresis: float = 0.05,
    ) -> None:
        if warmup_steps < 3:
            raise ConfigError(f"balance.warmup_steps={warmup_steps}: must be >= 3 (steps 1-2 "
                              "are not measured)")
        if rebalance_every < 1:
            raise ConfigError(f"balance.rebalance_every={rebalance_every}: must be >= 1")
        if not 0 <= ema < 1:
            raise ConfigError(f"balance.ema={ema}: must be in [0, 1) (weight of the past)")
        if not 0 <= hysteresis < 1:
            raise ConfigError(f"balance.hysteresis={hysteresis}: must be in [0, 1)")
        self.warmup_steps, self.rebalance_every = warmup_steps, rebalance_every
        self.ema, self.hysteresis = ema, hysteresis
        self.step = 0  # steps so far, resumed from checkpoints: the rebalancing schedule
        self.steps_here = 0  # steps this process ran: its first two are not measured
        self.measured_from: int | None = None  # first step of the window in the clock's list
        self.history: list[History] = []  # per rank, the same on every rank: see `steptime.py`
        self.models: list[StepTime] = []  # per rank, fitted at the last rebalancing
        self.rebalances = 0

    def validate(self, job: Job, options: Options) -> None:
        batch, accum = job.data["batch_size"], job.train.grad_accum
        need = job.launch.world_size * accum
        if batch < need:
            raise ConfigError(
                f"data.batch_size={batch}: too small to give each of {job.launch.world_size}"
                f" ranks x train.grad_accum ({accum}) at least one sample; use >= {need}"
            )

    def local_batch_size(self, global_batch: int, rank: int, world_size: int) -> int:
        """As equal as the global batch allows: the first (batch mod world size) ranks get +1."""
        return global_batch // world_size + (rank < global_batch % world_size)

    def before_step(self) -> None:
        self.step += 1
        self.steps_here += 1
        if self.steps_here == 3:  # not measured: this process's step 1 (lazy set-up) and step 2
            self.clock.totals()  # (whose simulated straggler delay is based on step 1)
            self.measured_from = len(self.clock.busy_s)
        done = self.step - 1
        if done >= self.warmup_steps and (done - self.warmup_steps) % self.rebalance_every == 0:
            self.rebalance()
        super().before_step()

    def rebalance(self) -> None:
        """All ranks: gather every rank's median step of the last window, then `update`."""
        self.clock.totals()  # resolves the last step
        measured = self.measured_from is not None
        window = self.clock.busy_s[self.measured_from :] if measured else []
        self.measured_from = len(self.clock.busy_s) if measured else None
        # The median step, not the mean: a rank descheduled for one step (a busy neighbour, a
        # page fault) would otherwise look slow for the whole window.
        medians = gather_rows([statistics.median(window) if window else 0.0], self.runtime)[:, 0]
        if medians.all():  # else no step measured yet (a resumed run's first two): keep the split
            self.update(medians.tolist())

    def update(self, medians: list[float]) -> None:
        """Each rank's median busy seconds at its current size, the same on every rank: add them
        to the history, fit every rank's step time, and apply the equal-finish split if it
        gains more than the hysteresis."""
        histories = self.history or [{} for _ in self.sizes]
        self.history = [remember(history, size, seconds, self.ema) for history, size, seconds
                        in zip(histories, self.sizes, medians, strict=True)]
        rates = torch.tensor(self.sizes, dtype=torch.float64) / torch.tensor(medians)
        priors = self.models or [None] * len(self.sizes)
        self.models = [fit(history, self.ema, prior).scaled(speed)
                       for history, prior, speed in zip(self.history, priors,
                                                        self.speeds(rates).tolist(), strict=True)]
        sizes = next_split(self.models, self.sizes, self.global_batch, self.grad_accum,
                           self.hysteresis)
        if sizes != self.sizes:
            log.info("step %d: split %s -> %s (slowest rank predicted %.2f -> %.2f ms; %s)",
                     self.step, self.sizes, sizes, 1e3 * slowest_s(self.models, self.sizes),
                     1e3 * slowest_s(self.models, sizes), describe(self.models))
            self.sizes = sizes
            self.loader.set_sizes(sizes)
            self.rebalances += 1

    def speeds(self, measured: torch.Tensor) -> torch.Tensor:
        """How many times faster each rank is expected to run than it just did, given the
        samples/s it measured: here 1, the measurements are the whole prediction."""
        return torch.ones_like(measured)

    def metrics(self) -> dict[str, float]:
        """The base metrics, the number of rebalancings and each rank's fitted step time."""
        fitted = {}
        for rank, model in enumerate(self.models):
            fitted[f"balance/fixed_s_rank{rank}"] = model.fixed_s
            fitted[f"balance/per_sample_s_rank{rank}"] = model.per_sample_s
        return {**super().metrics(), "balance/rebalances": float(self.rebalances), **fitted}

    def state_dict(self) -> dict:
        return {"world_size": self.runtime.world_size, "sizes": list(self.sizes), "step": self.step,
                "history": [dict(history) for history in self.history],
                "models": [tuple(model) for model in self.models], "rebalances": self.rebalances}

    def load_state_dict(self, state: dict) -> None:
        if state.get("world_size") != self.runtime.world_size:
            saved = (f"the checkpoint's split {state['sizes']} is for {state['world_size']} ranks"
                     if "sizes" in state else "the checkpoint holds no split (another balance)")
            log.info("balance: %s; starting from an equal split over %d ranks", saved,
                     self.runtime.world_size)
            return
        self.step, self.rebalances = state["step"], state["rebalances"]
        self.sizes = list(state["sizes"])
        # A checkpoint written before step times were fitted holds no history: fit afresh.
        self.history = [dict(history) for history in state.get("history", [])]
        self.models = [StepTime(*model) for model in state.get("models", [])]
        self.loader.set_sizes(self.sizes)
        log.info("balance: resumed with split %s (%s)", self.sizes, describe(self.models))
