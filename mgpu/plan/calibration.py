"""How good the planner is, run by run: the prediction for the layout a run trains, beside what
the run measured, so a sweep shows the model's error for every layout it ran.

Measured step time is the run's `time/step_p50_s`; measured memory is what every run logs of
the exact part, the largest parameter bytes plus the largest optimizer-state bytes of any rank
(`memory/param_bytes_per_rank`, `memory/optimizer_bytes_per_rank`), against the same sum
predicted. Errors are relative: predicted / measured - 1 (positive: predicted too much).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mgpu.plan.candidates import own_candidate
from mgpu.plan.machine import measure
from mgpu.plan.planner import Row, predict

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

PREDICTED_STEP = "plan/predicted_step_seconds"
PREDICTED_BYTES = "plan/predicted_bytes_per_rank"
ERROR_STEP = "plan/error_step_time"
ERROR_STATE = "plan/error_state_bytes"


def predict_own(job: Job, options: Options, cuda_devices: int) -> Row:
    """The prediction for the layout the job names, on this machine."""
    if options.planned is not None:  # strategy=auto: its chosen layout's row
        chosen = job.strategy
        return next(r for r in options.planned.rows if r.candidate.node == chosen)
    world = job.launch.world_size
    batch = max(1, job.data["batch_size"] // world // job.train.grad_accum)
    device = torch.device("cuda", 0) if cuda_devices else torch.device("cpu")
    machine = measure(options, batch, world, device)
    return predict(job, options, [own_candidate(job, options)], machine, None)[0]


def predicted(row: Row) -> dict[str, float]:
    return {PREDICTED_STEP: row.time.seconds, PREDICTED_BYTES: row.memory.device}


def errors(row: Row, summary: dict[str, float]) -> dict[str, float]:
    """The prediction beside the run's measured figures, where the run logged them."""
    out = predicted(row)
    measured_step = summary.get("time/step_p50_s")
    if measured_step:
        out[ERROR_STEP] = row.time.seconds / measured_step - 1
    params = summary.get("memory/param_bytes_per_rank")
    optimizer = summary.get("memory/optimizer_bytes_per_rank")
    if params:
        expected = max(m.params for m in row.ranks) + max(m.optimizer for m in row.ranks)
        out[ERROR_STATE] = expected / (params + (optimizer or 0.0)) - 1
    return out
