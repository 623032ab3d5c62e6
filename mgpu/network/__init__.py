"""Network settings: environment for the communication libraries, applied before workers start."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Network(Protocol):
    #: DDP gradient bucket settings, for the strategies that bucket gradients.
    bucket_cap_mb: float
    gradient_as_bucket_view: bool

    def env(self) -> dict[str, str]:
        """Environment variables this option sets (and only those) for the workers."""

    def prepare_node(self, output_dir: Path) -> dict[str, str]:
        """This machine's checks before the workers start; returns every variable to set."""
