"""`python -m mgpu.plan <hydra overrides>`: the ranked plan table of a job, without training."""

from __future__ import annotations

import sys

import torch
from hydra import compose, initialize_config_dir

from mgpu.config import prepare
from mgpu.errors import ConfigError
from mgpu.options import CONF
from mgpu.plan.machine import measure
from mgpu.plan.planner import format_table, plan_job
from mgpu.runtime import pick_device


def main(overrides: list[str]) -> int:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config",
                      overrides=[*overrides, "output_dir=.", "tracking.enabled=false"])
    try:
        job, options = prepare(cfg, torch.cuda.device_count(), None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    world = job.launch.world_size
    batch = max(1, job.data["batch_size"] // world // job.train.grad_accum)
    machine = measure(options, batch, world, pick_device(0))
    rows = plan_job(job, options, machine, None)
    print(f"{len(rows)} layouts of {world} ranks; links: {machine.source}")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
