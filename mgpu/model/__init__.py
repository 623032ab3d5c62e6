"""Models. Each is an nn.Module built from its YAML settings plus the data's shape, and names
its repeated blocks so strategies know where to cut (sharding units, checkpointing).

The input shape says what a sample is: (C, H, W) an image, labelled with one of `num_classes`
classes; (T,) a sequence of token ids from a vocabulary of `num_classes`, each position labelled
with the token after it (data sets that declare `next_token`), which only a model that
declares `language_model` reads."""

from __future__ import annotations

from typing import Protocol

from torch import nn

from mgpu.errors import ConfigError


class Model(Protocol):
    #: It normalises over the batch (BatchNorm): a rank's local batch changes its outputs.
    batch_statistics: bool
    #: It reads token sequences and predicts the next token at every position.
    language_model: bool

    def __call__(self, x): ...

    def blocks(self) -> list[nn.Module]:
        """The model's repeated units, in order."""


class PipelineStages(int):
    """A pipeline's number of stages, which remembers the settings that made it (`ranks` ranks
    holding `per_rank` stages each under `schedule`), so that a model refusing that many stages
    names the keys the user set, not a count the schedule derived."""

    def __new__(cls, ranks: int, per_rank: int = 1, schedule: str = "") -> PipelineStages:
        stages = super().__new__(cls, ranks * per_rank)
        stages.ranks, stages.per_rank, stages.schedule = ranks, per_rank, schedule
        return stages


def check_pipeline_blocks(stages: int, blocks: int, what: str) -> None:
    """ConfigError where `stages` pipeline stages would leave a stage without a block; `what`
    names the setting that counts the blocks ("model.layers=3")."""
    if stages <= blocks:
        return
    per_rank = getattr(stages, "per_rank", 1)
    if per_rank > 1:
        raise ConfigError(
            f"strategy.schedule={stages.schedule}: {per_rank} stages on each of the "
            f"{stages.ranks} pipeline ranks make {int(stages)}, more than {what}; use a schedule "
            f"of one stage per rank (gpipe, 1f1b) or at most {blocks // per_rank} pipeline ranks"
        )
    raise ConfigError(
        f"strategy pp={stages}: more pipeline stages than {what}; use pp <= {blocks}"
    )


def keep_stage_blocks(blocks: nn.ModuleDict, stage: int, stages: int) -> None:
    """Delete from `blocks` (in model order) all but pipeline stage `stage`'s even share of
    `stages`; the kept blocks keep their names, so the stage's state_dict keys are the whole
    model's."""
    names = list(blocks.keys())
    bounds = [round(i * len(names) / stages) for i in range(stages + 1)]
    keep = set(names[bounds[stage]:bounds[stage + 1]])
    for name in names:
        if name not in keep:
            del blocks[name]
