"""Balance: how the fixed global batch is split across ranks."""

from __future__ import annotations

from typing import Protocol


class Balance(Protocol):
    def local_batch_size(self, global_batch: int, rank: int, world_size: int) -> int:
        """Samples this rank takes from each global batch."""

    def state_dict(self) -> dict:
        """What the policy has learned (e.g. measured rank speeds), for checkpoints."""

    def load_state_dict(self, state: dict) -> None: ...
