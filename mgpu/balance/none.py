"""Equal split: every rank takes global batch / world size samples per step."""

from __future__ import annotations


class EqualSplit:
    def local_batch_size(self, global_batch: int, rank: int, world_size: int) -> int:
        return global_batch // world_size

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
