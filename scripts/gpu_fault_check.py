"""Fault tolerance on CUDA/nccl (needs 2 GPUs): a hang leaves NCCL flight-recorder dumps and
names the rank; a killed rank restarts and resumes from its checkpoint.

    python scripts/gpu_fault_check.py        # prints one line per check; exit 1 if one fails
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

QUICK = ["train.steps=30", "train.warmup_steps=5", "train.log_every=10", "eval.every_steps=0",
         "tracking.enabled=false", "launch.nproc_per_node=2"]


def mgpu(args: list[str], out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mgpu", *QUICK, *args, f"hydra.run.dir={out}"],
                          capture_output=True, text=True, timeout=600)


def main() -> int:
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "hang")
        hang = mgpu(["fault.mode=hang", "fault.kill_rank=1", "fault.at_step=5",
                     "launch.timeout_s=20"], out)
        dumps = sorted(p.name for p in (out / "logs").glob("nccl_trace_rank_*"))
        ok = hang.returncode == 1 and "rank 1 hung" in hang.stderr and bool(dumps)
        failures += not ok
        print(f"hang: {'ok' if ok else 'FAILED'}: {hang.stderr.strip().splitlines()[-1:]}, "
              f"flight-recorder dumps {dumps}")
        out = Path(tmp, "kill")
        kill = mgpu(["checkpoint.every_steps=10", "fault.mode=sigkill", "fault.kill_rank=1",
                     "fault.at_step=15", "launch.max_restarts=1"], out)
        log = (out / "logs" / "rank0.log").read_text() if out.exists() else ""
        ok = kill.returncode == 0 and "resumed from" in log
        failures += not ok
        print(f"sigkill restart: {'ok' if ok else 'FAILED'} (exit {kill.returncode})")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.pop("HYDRA_FULL_ERROR", None)
    sys.exit(main())
