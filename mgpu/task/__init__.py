"""Tasks: what the workers do once the process group is up: train, or benchmark the network."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mgpu.runtime import Runtime

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options


class Task(Protocol):
    #: The summary key a Hydra sweeper optimises (returned by `python -m mgpu`).
    objective: str
    #: What the task writes into the output dir, as the closing lines list it.
    outputs: tuple[str, ...]

    def run(
        self, job: Job, options: Options, runtime: Runtime, run_id: str | None
    ) -> dict[str, float]:
        """Do the task on this rank; rank 0's summary reaches the parent."""

    def summary_line(self, summary: dict[str, float]) -> str:
        """The headline figures for the final report, in one line."""
