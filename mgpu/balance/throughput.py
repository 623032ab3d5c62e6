"""Throughput-proportional split: faster ranks take more of the (fixed) global batch.

Each rank measures the samples/s of its own work in the median step of a window (forward +
backward up to its last local gradient, excluding the wait for peers: see `clock.py`). After
`warmup_steps` steps, and then every `rebalance_every` steps, the ranks all-gather these rates,
smooth them (EMA), and every rank computes the same integer split proportional to them. A
split proportional to throughput makes the ranks finish their work at the same moment, the
fastest a synchronous step can be. The new split is applied only if some rank's share moves
by more than `hysteresis` of the global batch, so measurement noise does not make sizes
oscillate.

A checkpoint holds the split, the smoothed rates, the step count (the rebalancing schedule) and
the number of rebalancings, so a resumed run goes on from the split it had; at another world
size it starts from an equal split, said in one log line.

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
from mgpu.errors import ConfigError
from mgpu.runtime import gather_rows

if TYPE_CHECKING:
    from mgpu.config import Job, Options

log = logging.getLogger(__name__)


def proportional_split(speeds: list[float], total: int, minimum: int) -> list[int]:
    """Integers >= `minimum`, summing to `total`, proportional to `speeds` (largest remainder).

    Ties go to the lower rank, so every rank computes the same split from the same speeds.
    """
    weight = sum(speeds)
    quotas = [total * s / weight if weight > 0 else total / len(speeds) for s in speeds]
    sizes = [max(minimum, int(q)) for q in quotas]
    ranks = range(len(speeds))
    while sum(sizes) < total:  # the ranks furthest below their quota get one more
        sizes[min(ranks, key=lambda r: (sizes[r] - quotas[r], r))] += 1
    while sum(sizes) > total:  # raising some to the minimum overshot: take from the furthest above
        sizes[max((r for r in ranks if sizes[r] > minimum),
                  key=lambda r: (sizes[r] - quotas[r], -r))] -= 1
    return sizes


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
        self.smoothed: torch.Tensor | None = None
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
            self.measured_from = len(self.clock.busy_per_sample)
        done = self.step - 1
        if done >= self.warmup_steps and (done - self.warmup_steps) % self.rebalance_every == 0:
            self.rebalance()
        super().before_step()

    def rebalance(self) -> None:
        """All ranks: gather the rates of the last window, smooth them, maybe apply a new split."""
        self.clock.totals()  # resolves the last step
        measured = self.measured_from is not None
        window = self.clock.busy_per_sample[self.measured_from :] if measured else []
        self.measured_from = len(self.clock.busy_per_sample) if measured else None
        # The median step, not the mean: a rank descheduled for one step (a busy neighbour, a
        # page fault) would otherwise look slow for the whole window.
        seconds = statistics.median(window) if window else 0.0
        rates = gather_rows([1 / seconds if seconds > 0 else 0.0], self.runtime)[:, 0]
        if not rates.all():  # no step measured yet (a resumed run's first two): keep the split
            return
        if self.smoothed is None:
            self.smoothed = rates
        else:
            self.smoothed = self.ema * self.smoothed + (1 - self.ema) * rates
        sizes = proportional_split(self.speeds(self.smoothed).tolist(), self.global_batch,
                                   self.grad_accum)
        moved = max(abs(new - old) for new, old in zip(sizes, self.sizes, strict=True))
        if moved > self.hysteresis * self.global_batch:
            log.info("step %d: split %s -> %s (samples/s per rank %s)", self.step, self.sizes,
                     sizes, [round(r) for r in self.smoothed.tolist()])
            self.sizes = sizes
            self.loader.set_sizes(sizes)
            self.rebalances += 1

    def speeds(self, measured: torch.Tensor) -> torch.Tensor:
        """What the split is proportional to: here the smoothed measured samples/s."""
        return measured

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "balance/rebalances": float(self.rebalances)}

    def state_dict(self) -> dict:
        return {"world_size": self.runtime.world_size, "sizes": list(self.sizes), "step": self.step,
                "smoothed": self.smoothed, "rebalances": self.rebalances}

    def load_state_dict(self, state: dict) -> None:
        if state.get("world_size") != self.runtime.world_size:
            saved = (f"the checkpoint's split {state['sizes']} is for {state['world_size']} ranks"
                     if "sizes" in state else "the checkpoint holds no split (another balance)")
            log.info("balance: %s; starting from an equal split over %d ranks", saved,
                     self.runtime.world_size)
            return
        self.step, self.rebalances = state["step"], state["rebalances"]
        self.smoothed = state["smoothed"]
        self.sizes = list(state["sizes"])
        self.loader.set_sizes(self.sizes)
        log.info("balance: resumed with split %s (samples/s per rank %s)", self.sizes,
                 None if self.smoothed is None else [round(r) for r in self.smoothed.tolist()])
