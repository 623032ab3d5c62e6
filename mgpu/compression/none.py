"""No compression: DDP's own fp32 all-reduce."""

from __future__ import annotations

from torch import nn


class NoCompression:
    def register(self, model: nn.Module) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
