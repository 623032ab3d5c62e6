"""Small convolutional network for image inputs (C, H, W): a sequence of conv blocks (a
convolution, its BatchNorm and activation, one per width of `channels`), then a head (pooling
and two linear layers).

The model states what the parallel strategies need: its blocks (FSDP units, activation
checkpointing, pipeline cuts) and its pipeline stages. It has no tensor-parallel plan: torch's
tensor-parallel styles cover Linear and Embedding layers only.
"""

from __future__ import annotations

import torch
from torch import nn

from mgpu.errors import ConfigError
from mgpu.model import check_pipeline_blocks, keep_stage_blocks

CHANNELS = (32, 64)


class CNN(nn.Module):
    batch_statistics = True  # BatchNorm
    language_model = False

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        channels: list[int] = CHANNELS,
        hidden: int = 128,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"model=cnn needs image inputs (C, H, W), got shape {input_shape}")
        sizes = [input_shape[0], *channels]
        # A dict keyed "0".."N-1", not a list: pipeline stages delete the blocks they don't own
        # and the rest keep their names, so every stage's state_dict keys match the whole model.
        self.convs = nn.ModuleDict({
            str(i): nn.Sequential(nn.Conv2d(i_size, o_size, 3, padding=1),
                                  nn.BatchNorm2d(o_size), nn.ReLU())
            for i, (i_size, o_size) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
        })
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(sizes[-1] * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    @classmethod
    def check_parallel(
        cls, settings: dict, tp: int, pp: int, sequence_parallel: bool = False,
        input_shape: tuple[int, ...] = (),
    ) -> None:
        """ConfigError where `pp` stages would leave a stage without a conv block (tensor
        parallelism is refused by `mgpu.support`: the model has no tp_plan)."""
        if sequence_parallel:
            raise ConfigError(
                "strategy.sequence_parallel=true: model=cnn reads no sequence to split; "
                "use strategy.sequence_parallel=false"
            )
        channels = list(settings.get("channels", CHANNELS))
        check_pipeline_blocks(pp, len(channels), f"the {len(channels)} widths of model.channels")

    def blocks(self) -> list[nn.Module]:
        return list(self.convs.values())

    def pipeline_stage(self, stage: int, stages: int) -> CNN:
        """This model cut down in place to pipeline stage `stage` of `stages`: an even share of
        the conv blocks, the pooling and head on the last stage."""
        keep_stage_blocks(self.convs, stage, stages)
        if stage != stages - 1:
            self.pool = self.head = None
        return self

    def tied_parameters(self) -> tuple[str, ...]:
        """No weight is held by two pipeline stages."""
        return ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs.values():
            x = conv(x)
        return x if self.head is None else self.head(self.pool(x))
