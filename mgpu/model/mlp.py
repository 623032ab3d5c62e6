"""Multi-layer perceptron over flattened inputs: a sequence of blocks (a linear layer and its
activation, one per width of `hidden`) and a linear class head.

The model states what the parallel strategies need: its blocks (FSDP units, activation
checkpointing, pipeline cuts), its tensor-parallel plan and its pipeline stages.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from mgpu.errors import ConfigError
from mgpu.model import check_pipeline_blocks, keep_stage_blocks

HIDDEN = (256, 256)


class MLP(nn.Module):
    batch_statistics = False
    language_model = False

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: list[int] = HIDDEN,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        sizes = [math.prod(input_shape), *hidden]
        # No Dropout module at p=0: it would still cost a call per layer and step.
        # A dict keyed "0".."N-1", not a list: pipeline stages delete the blocks they don't own
        # and the rest keep their names, so every stage's state_dict keys match the whole model.
        self.layers = nn.ModuleDict({
            str(i): nn.Sequential(
                nn.Linear(i_size, o_size), nn.ReLU(),
                *([nn.Dropout(dropout)] if dropout else []),
            )
            for i, (i_size, o_size) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
        })
        self.head = nn.Linear(sizes[-1], num_classes)

    @classmethod
    def check_parallel(
        cls, settings: dict, tp: int, pp: int, sequence_parallel: bool = False,
        input_shape: tuple[int, ...] = (),
    ) -> None:
        """ConfigError where `tp` ranks cannot split every hidden width, where sequence
        parallelism is asked of a model without a sequence, or `pp` stages the blocks."""
        hidden = list(settings.get("hidden", HIDDEN))
        if any(width % tp for width in hidden):
            raise ConfigError(
                f"strategy tp={tp}: must divide every width of model.hidden={hidden}; "
                f"pick a tp degree that divides each, or widths that tp divides"
            )
        if sequence_parallel:
            raise ConfigError(
                "strategy.sequence_parallel=true: model=mlp reads no sequence to split; "
                "use strategy.sequence_parallel=false"
            )
        check_pipeline_blocks(pp, len(hidden), f"the {len(hidden)} widths of model.hidden")

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    @staticmethod
    def tp_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Per-block tensor-parallel plan: each rank computes a slice of the block's output
        columns, gathered whole after the layer (Megatron's column-parallel layer with its
        output gathered). A block holds one linear layer, and every block gets the same plan,
        so blocks cannot alternate column- and row-wise splits; the gather keeps each block's
        input and output replicated. `sequence_parallel` is refused in the parent
        (`check_parallel`): there is no sequence."""
        return {"0": ColwiseParallel(output_layouts=Replicate())}

    def pipeline_stage(self, stage: int, stages: int) -> MLP:
        """This model cut down in place to pipeline stage `stage` of `stages`: an even share of
        the blocks, the head on the last stage."""
        keep_stage_blocks(self.layers, stage, stages)
        if stage != stages - 1:
            self.head = None
        return self

    def tied_parameters(self) -> tuple[str, ...]:
        """No weight is held by two pipeline stages."""
        return ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)  # images in on the first stage; (batch, width) is already flat
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(x)
