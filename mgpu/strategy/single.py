"""One process, no communication: the reference every parallel strategy must match."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn

from mgpu.errors import ConfigError
from mgpu.runtime import Runtime


class Single:
    world_size = 1

    def validate(self, job: dict) -> None:
        if job["launch"]["world_size"] != 1:
            raise ConfigError(
                f"strategy=single runs one process but launch.nproc_per_node="
                f"{job['launch']['nproc_per_node']} x nnodes={job['launch']['nnodes']} gives "
                f"{job['launch']['world_size']}; use launch.nproc_per_node=auto or strategy=ddp"
            )

    def wrap(self, model: nn.Module, rt: Runtime, network: object) -> nn.Module:
        return model.to(rt.device)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()
