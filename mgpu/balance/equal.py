"""Equal split: every rank takes global batch / world size samples per step.

This is also the base of the other options: it owns the step clock (timings and the simulated
straggler, see `clock.py`), the loss weighting and the per-rank metrics. The clock only runs
where a straggler is simulated or an option needs measurements, so the default run has no
hooks at all.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from mgpu.balance.clock import StepClock
from mgpu.data.loader import TrainBatches
from mgpu.runtime import Runtime, gather_rows
from mgpu.straggler import Straggler

if TYPE_CHECKING:
    from mgpu.compression import CommHook
    from mgpu.job import StragglerConf


class EqualSplit:
    uneven = False
    measures = False  # whether the option needs the step clock even without a straggler
    needs_comm_hook = False
    carries_compression = False
    stateful = False
    exact = True
    deterministic = True

    def local_batch_size(self, global_batch: int, rank: int, world_size: int) -> int:
        return global_batch // world_size

    def attach(
        self, model: nn.Module, runtime: Runtime, global_batch: int, grad_accum: int,
        straggler: StragglerConf, seed: int,
    ) -> None:
        self.runtime, self.seed = runtime, seed
        self.global_batch, self.grad_accum = global_batch, grad_accum
        self.sizes = [self.local_batch_size(global_batch, r, runtime.world_size)
                      for r in range(runtime.world_size)]
        # `straggler.slowdown` has one factor per process: by global rank, where `runtime` is
        # the data-parallel one (every stage of a pipeline is data-parallel rank 0).
        rank = dist.get_rank() if dist.is_initialized() else runtime.rank
        delay = Straggler(**dataclasses.asdict(straggler), rank=rank, seed=seed)
        self.clock = None
        # Decided from the whole section, not this rank's delay: every rank must run the clock,
        # since its metrics are collectives.
        if straggler.slowdown or straggler.jitter_s > 0 or self.measures:
            self.clock = StepClock(delay, runtime.device)
            self.clock.attach(model)
            self.logged = self.clock.totals()

    def comm_hook(self, model: nn.Module, compression: object = None,
                  compression_hook: CommHook | None = None) -> CommHook | None:
        """None: the split changes what each rank computes, not how gradients travel."""
        return None

    def batches(self, dataset: Dataset) -> TrainBatches:
        self.loader = TrainBatches(dataset, self.sizes, self.grad_accum, self.runtime, self.seed)
        return self.loader

    def loss_divisor(self, micro_batch: int) -> float:
        """global batch / (micro-batch x world size): DDP averages the ranks' gradients with
        equal weight, so each micro-batch's mean loss is scaled by its share of the global
        batch (times the world size). On an equal split this is exactly `grad_accum`."""
        return self.global_batch / (micro_batch * self.runtime.world_size)

    def before_step(self) -> None:
        if self.clock:
            self.clock.start_step(self.sizes[self.runtime.rank])

    def after_backward(self) -> None:
        if self.clock:
            self.clock.end_backward()

    def carried_scale(self, grad_scale: torch.Tensor | None) -> torch.Tensor | None:
        return grad_scale

    def has_gradients(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        """Batch sizes, samples/s of each rank's own work, imbalance and the wait for peers."""
        if not self.clock:
            return {}
        totals = self.clock.totals()
        steps, samples, busy, wait = (totals[k] - self.logged[k] for k in totals)
        self.logged = totals
        rows = gather_rows([samples, busy, wait, max(steps, 1)], self.runtime)
        samples, busy, wait, steps = rows.unbind(1)
        busy_per_step = busy / steps
        metrics = {f"balance/batch_rank{r}": float(size) for r, size in enumerate(self.sizes)}
        for rank, (n, seconds) in enumerate(zip(samples.tolist(), busy.tolist(), strict=True)):
            metrics[f"balance/samples_per_s_rank{rank}"] = n / seconds if seconds else 0.0
        metrics["balance/imbalance"] = float(busy_per_step.max() / busy_per_step.min().clamp(
            min=1e-9))
        metrics["time/sync_wait_s"] = float((wait / steps).max())
        return metrics

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
