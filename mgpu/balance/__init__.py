"""Balance: how the fixed global batch is split across ranks, and how ranks wait for each other."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset

from mgpu.runtime import Runtime

if TYPE_CHECKING:
    from mgpu.compression import CommHook
    from mgpu.job import Job, StragglerConf
    from mgpu.options import Options


class Balance(Protocol):
    """What a balance declares, read by `mgpu.support` and the support matrix."""

    #: True where ranks may get different shares (the batch need not divide by the world size).
    uneven: bool
    #: It times each rank's own work with the step clock, even without a simulated straggler.
    measures: bool
    #: It works through a DDP comm hook (the strategy must take one, and nothing else install one).
    needs_comm_hook: bool
    #: Its comm hook carries a compression's: sends gradients in its wire dtype (fp16/bf16),
    #: or runs its hook's exchange in place of its own all-reduce (where the compression
    #: `overlaps_steps`), so the compression installs no hook of its own.
    carries_compression: bool
    #: It learns from step to step (measured rates, a split, gradients in flight): checkpointed.
    stateful: bool
    #: Each step applies that step's averaged gradients (not older ones).
    exact: bool
    #: The same seed gives bitwise the same run (not so where the split follows measured time).
    deterministic: bool

    def validate(self, job: Job, options: Options) -> None:
        """Raise ConfigError for settings this option cannot run with (parent, before launch)."""

    def local_batch_size(self, global_batch: int, rank: int, world_size: int) -> int:
        """Samples this rank takes from each global batch at the start."""

    def attach(
        self, model: nn.Module, runtime: Runtime, global_batch: int, grad_accum: int,
        straggler: StragglerConf, seed: int,
    ) -> None:
        """Set up for the wrapped model, `global_batch` samples per optimizer step in
        `grad_accum` micro-batches: the step clock's hooks (and the simulated `straggler`),
        where it runs."""

    def comm_hook(self, model: nn.Module, compression: object = None,
                  compression_hook: CommHook | None = None) -> CommHook | None:
        """After `attach`: the DDP comm hook this option works through, or None (most options);
        `Trainer.build` registers it. Where the option `carries_compression`, its hook sends in
        `compression`'s wire dtype and counts its bytes there, or runs `compression_hook` (the
        compression's own) for each bucket."""

    def batches(self, dataset: Dataset) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches, endless."""

    def loss_divisor(self, micro_batch: int) -> float:
        """Divide a micro-batch's mean loss by this so DDP's mean of gradients is exact."""

    def before_step(self) -> None: ...

    def after_backward(self) -> None: ...

    def carried_scale(self, grad_scale: torch.Tensor | None) -> torch.Tensor | None:
        """After backward: the loss scale the gradients this step applies carry, given the one
        this step's backward ran under (`grad_scale`, None without loss scaling). The same,
        except where the applied gradients were computed at an earlier step (ssp)."""

    def has_gradients(self) -> bool:
        """Whether this step's synchronised gradients are to be applied (ssp's first
        `staleness` steps have none: the optimizer step is left out)."""

    def metrics(self) -> dict[str, float]:
        """Per-rank batch sizes and speeds since the last call (a collective: every rank calls)."""

    def state_dict(self) -> dict:
        """What the policy has learned and holds (the split, measured rank speeds, gradients
        in flight), for checkpoints; the same on every rank."""

    def load_state_dict(self, state: dict) -> None: ...
