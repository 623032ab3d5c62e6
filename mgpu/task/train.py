"""Train the model (the default task): build the run, train, evaluate, save the weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mgpu.run import Run
from mgpu.runtime import Runtime

if TYPE_CHECKING:
    from mgpu.config import Job


class Train:
    objective = "eval/accuracy"

    def run(self, job: Job, rt: Runtime, run_id: str | None) -> dict[str, float]:
        run = Run.build(job, rt, run_id)
        try:
            summary = run.train()
            run.save_weights()
            return summary
        finally:
            run.close()

    def summary_line(self, summary: dict[str, float]) -> str:
        return (
            f"eval/accuracy {summary['eval/accuracy']:.4f}, "
            f"{summary.get('train/samples_per_s', 0):,.0f} samples/s"
        )
