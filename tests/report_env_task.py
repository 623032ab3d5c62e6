"""A task for tests: each worker reports the communication settings it actually runs with.

It plugs in like a user's own task (`task._target_=tests.report_env_task.ReportEnv`).
"""

from __future__ import annotations

import os

from torch import nn

from mgpu.job import Job
from mgpu.options import Options
from mgpu.parallel import parallelize
from mgpu.runtime import Runtime


class ReportEnv:
    objective = "bucket_bytes_cap"

    def run(
        self, job: Job, options: Options, runtime: Runtime, run_id: str | None
    ) -> dict:
        plan = options.strategy.plan(runtime.world_size)
        layout = parallelize(
            nn.Linear(4, 2), plan, plan.device_mesh(runtime.device), runtime.device,
            options.precision, options.network,
        )
        model = layout.model
        return {
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_"))},
            "bucket_bytes_cap": model.bucket_bytes_cap,
            "gradient_as_bucket_view": model.gradient_as_bucket_view,
        }

    def summary_line(self, summary: dict) -> str:
        return f"bucket_bytes_cap {summary['bucket_bytes_cap']}"
