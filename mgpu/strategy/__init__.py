"""Parallel strategies: how the model is placed on ranks and how its gradients are synchronised.

A strategy is settings that build a `ParallelPlan` (`plan`); `mgpu.parallel.parallelize` lays
the model out by it, and the strategy runs the step on the `Layout` it is given (`use`). What
differs between strategies is their plan and what they declare; the step, evaluation and
export follow from the layout (a pipeline or not; DDP, FSDP2 or neither), so they live here
once. zero1 alone adds its own optimizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mgpu.loss import cross_entropy
from mgpu.meter import memory_metrics
from mgpu.parallel import DDPOptions, FSDPOptions, Layout, ParallelPlan, check_activation_recompute
from mgpu.parallel.fsdp import gradient_sync_off
from mgpu.parallel.wire import DTensorWireCount
from mgpu.pipeline import Pipeline
from mgpu.precision.padding import unpad_state_dict

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

#: Optimizer state in DCP's flat layout, every entry keyed by parameter name
#: (`state.<name>.exp_avg`, `param_groups.<name>.lr`): ranks holding different parameters
#: (pipeline stages, ZeRO partitions) write disjoint keys, and a run split another way loads
#: its own parameters' entries. The nested layout keeps param groups as lists per rank, which
#: collide across ranks that hold different parameters.
BY_PARAMETER_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
#: The bytes a rank sends per training step, wherever they are counted.
WIRE = "comm/bytes_per_step"
#: Where a pipeline's state dict keys hold the index of the stage in this rank's list of
#: stages (`0.layers.3.weight`, `state.0.layers.3.weight.momentum_buffer`): dropped in
#: checkpoints, so that they hold the model's own names (`Pipeline.own_names`).
MODEL_KEY_STAGE, OPTIM_KEY_STAGE = 0, 1
#: Param-group settings that choose how the optimizer computes its step, not what it computes:
#: fused kernels have no rules for DTensors, so each run keeps its own choice, whatever the
#: strategy that saved the checkpoint chose (a pipeline's plain tensors, FSDP's DTensors).
KERNEL_SETTINGS = ("fused", "foreach", "capturable", "differentiable")


def load_keeping_kernels(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load `state` (keyed by parameter name) into `optimizer`, except its `KERNEL_SETTINGS`."""
    own = [{k: group[k] for k in KERNEL_SETTINGS if k in group} for group in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, state, options=BY_PARAMETER_NAME)
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        group.update(settings)


class Strategy(ABC):
    """What a strategy declares (plain class attributes, or properties where its settings
    decide), read by the cross-group rules in `mgpu.support` and the support matrix; its plan;
    and the step on the layout built from that plan."""

    #: Number of processes the strategy requires, or None for any.
    world_size: int | None = None
    #: Every rank holds every parameter whole, so all ranks' gradients agree after the step.
    replicates_params: bool
    #: Gradients travel through DDP, so a compression's or a balance's comm hook can carry them.
    supports_comm_hook: bool
    #: Each rank keeps the optimizer state of its own share of the parameters only.
    shards_optimizer: bool
    #: The model is cut into pipeline stages whose schedule runs forward and backward itself.
    pipelined: bool
    #: Ranks may take unequal shares of the global batch, and a rank's forward and backward
    #: hold no collective but FSDP2's (whose calls the balance clock times and takes out), so
    #: its step time is its own work (what balance options split by).
    uneven_batches: bool
    #: Model methods the strategy splits the model with (`mgpu.support.MODEL_PLANS`).
    model_plans: tuple[str, ...]
    #: Gradients are reduce-scattered by FSDP2 in a dtype it is given (its reduce_dtype), so a
    #: compression that is only a wire dtype runs without a comm hook.
    sets_reduce_dtype: bool = False

    #: The layout the run trains, once `use` is given it (in each worker).
    layout: Layout | None = None
    #: Tensor parallelism's collectives, counted on the first training step (`counting`).
    tensor_wire: DTensorWireCount | None = None
    tensor_wire_counted = False

    def __init__(self, activation_checkpointing: str = "none") -> None:
        """Every strategy takes `activation_checkpointing` (none | full | selective)."""
        check_activation_recompute(activation_checkpointing)
        self.activation_checkpointing = activation_checkpointing

    @abstractmethod
    def plan(self, world_size: int) -> ParallelPlan:
        """This strategy's layout of one model over `world_size` ranks."""

    def validate(self, job: Job, options: Options) -> None:
        """Raise ConfigError for settings this strategy cannot run with (parent, before launch):
        what its plan asks of the batch, the data and the model."""
        self.plan(job.launch.world_size).check(job.model, options.data)

    def use(self, layout: Layout) -> None:
        """Run the step, evaluation and export on `layout` (the model `parallelize` made)."""
        self.layout = layout
        self.tensor_wire = DTensorWireCount() if layout.plan.tp > 1 else None
        self.tensor_wire_counted = False

    def counting(self) -> AbstractContextManager:
        """The context of a training step: on the first, tensor parallelism's collectives are
        counted (`mgpu.parallel.wire`; the same every step, so one step tells)."""
        if self.tensor_wire is None or self.tensor_wire_counted:
            return nullcontext()
        self.tensor_wire_counted = True
        return self.tensor_wire

    @property
    def pipe(self) -> Pipeline | None:
        """The layout's pipeline, where the plan has one: it runs the step itself."""
        return self.layout.pipe if self.layout is not None else None

    @property
    def steps_optimizer(self) -> bool:
        """The layout steps the optimizer itself, per stage, when a step's gradients are
        complete (a no-flush pipeline: `mgpu.twobw`), given the step as `hand_optimizer_step`."""
        return self.pipe is not None and self.pipe.no_flush is not None

    def hand_optimizer_step(self, step: Callable[[], None]) -> None:
        """Give a layout that `steps_optimizer` the run's optimizer step."""
        self.pipe.no_flush.update = step

    def drain(self) -> None:
        """Finish every micro-batch in flight and apply its update (a no-flush pipeline),
        before evaluation, a checkpoint or the end; every rank calls it."""
        if self.pipe is not None:
            self.pipe.drain()

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Context for micro-batches whose gradients are only accumulated, not synchronised.

        A pipeline's schedule reduces its stages' gradients over data-parallel ranks at the end
        of every step itself (FSDP2 adds each reduction to the gradient already reduced, so
        that stays exact); what it leaves to the last micro-batch is summing the tied weights.
        """
        data_parallel = self.layout.plan.data_parallel
        if self.pipe is not None:
            return self.pipe.accumulating()
        if isinstance(data_parallel, DDPOptions):
            return model.no_sync()
        if isinstance(data_parallel, FSDPOptions):
            return gradient_sync_off(model)
        return nullcontext()  # nothing synchronises gradients

    def build_optimizer(
        self, optim: object, model: nn.Module, total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer over this rank's (local, possibly sharded) parameters."""
        return optim.build(model.parameters(), total_steps)

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model's state for a DCP checkpoint, keyed by the model's own parameter names
        under every layout (a sharded model's shards as DTensors); also the template a
        checkpoint loads into. Every rank calls it."""
        state = get_model_state_dict(model)
        return self.pipe.own_names(state, MODEL_KEY_STAGE) if self.pipe is not None else state

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Put the state `model_state_dict`'s template was loaded with into the model."""
        if self.pipe is not None:
            state = self.pipe.stage_names(state, get_model_state_dict(model), MODEL_KEY_STAGE)
        set_model_state_dict(model, state)

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """The optimizer's state for a DCP checkpoint, keyed by parameter name (a sharded
        optimizer's shards as DTensors); also the template a checkpoint loads into. Every rank
        calls it."""
        state = get_optimizer_state_dict(model, optimizer, options=BY_PARAMETER_NAME)
        return self.pipe.own_names(state, OPTIM_KEY_STAGE) if self.pipe is not None else state

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Put the state `optimizer_state_dict`'s template was loaded with into the optimizer."""
        if self.pipe is not None:
            template = get_optimizer_state_dict(model, optimizer, options=BY_PARAMETER_NAME)
            state = self.pipe.stage_names(state, template, OPTIM_KEY_STAGE)
        load_keeping_kernels(model, optimizer, state)

    def forward_backward(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, precision: object,
        divisor: float, timer: object,
    ) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; returns the detached loss.

        The loss is divided by `divisor`, the micro-batch's weight in the global batch
        (train.grad_accum on an equal split); `timer` times the phases (a no-op unless
        monitoring is on).
        """
        if self.pipe is not None:
            # The schedule interleaves forward and backward passes: timed as one phase.
            with timer.phase("backward"), precision.autocast(inputs.device):
                return self.pipe.forward_backward(inputs, labels, precision.grad_scale(),
                                                  divisor)
        with timer.phase("forward"), precision.autocast(inputs.device):
            loss = cross_entropy(model(inputs), labels)
        with timer.phase("backward"):
            precision.backward(loss / divisor if divisor != 1 else loss)
        return loss.detach()

    def predict(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """Logits for `inputs` (evaluation, under no_grad)."""
        return self.pipe.predict(inputs) if self.pipe is not None else model(inputs)

    def metrics(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Strategy figures at a log point: bytes of parameters and optimizer state per rank,
        a pipeline's own (bubble, bytes sent between stages), and the bytes tensor
        parallelism's collectives send per step (added to a pipeline's)."""
        pipeline = self.pipe.metrics() if self.pipe is not None else {}
        figures = {**memory_metrics(model.parameters(), optimizer), **pipeline}
        if self.tensor_wire is not None and self.tensor_wire.wire_bytes:
            figures[WIRE] = figures.get(WIRE, 0.0) + self.tensor_wire.wire_bytes
        return figures

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU at the model's own sizes (tensor-core padding cut
        off), complete on rank 0; every rank must call it."""
        if self.pipe is not None:
            return self.pipe.full_state_dict()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return unpad_state_dict(get_model_state_dict(model, options=options), model)
