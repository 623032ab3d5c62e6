"""Train the model (the default task): build the trainer, train, evaluate, save the weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mgpu.runtime import Runtime
from mgpu.trainer import Trainer

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options


class Train:
    objective = "eval/accuracy"
    outputs = ("model.pt", "summary.json", "logs/")
    #: It trains the job's layout, so the planner's prediction for it is logged beside it.
    trains = True

    def run(
        self, job: Job, options: Options, runtime: Runtime, run_id: str | None
    ) -> dict[str, float]:
        trainer = Trainer.build(job, runtime, run_id, options)
        try:
            summary = trainer.train()
            trainer.save_weights()
            return summary
        finally:
            trainer.close()

    def summary_line(self, summary: dict[str, float]) -> str:
        return (
            f"eval/accuracy {summary['eval/accuracy']:.4f}, "
            f"{summary.get('train/samples_per_s', 0):,.0f} samples/s"
        )
