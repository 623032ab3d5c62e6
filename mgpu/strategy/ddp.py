"""Distributed data parallel: a full replica per rank, gradients all-reduced in buckets."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mgpu.parallel import apply_checkpointing, check_checkpointing
from mgpu.runtime import Runtime
from mgpu.strategy import Strategy


class DDP(Strategy):
    world_size = None
    replicates_params = True
    supports_comm_hook = True  # compressions and balance=ssp register DDP comm hooks
    shards_optimizer = False
    pipelined = False
    uneven_batches = True  # the all-reduce starts once a rank's own backward is done
    model_plans = ()

    def __init__(
        self,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        activation_checkpointing: str = "none",
    ) -> None:
        check_checkpointing(activation_checkpointing)
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.activation_checkpointing = activation_checkpointing

    def wrap(
        self, model: nn.Module, rt: Runtime, network: object, precision: object
    ) -> nn.Module:
        apply_checkpointing(model, self.activation_checkpointing)
        model = model.to(rt.device)
        return DistributedDataParallel(
            model,
            device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
            bucket_cap_mb=network.bucket_cap_mb,
            gradient_as_bucket_view=network.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
        )

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return model.no_sync()
