"""Elastic membership: a job whose nodes come and go runs as a series of worker groups.

torch's elastic agent restarts the worker group when a node leaves (its peers fail, and
`launch.max_restarts` allows another try) or joins (`launch.nnodes=MIN:MAX`, below MAX). Each
new group resumes the job's last checkpoint at its own world size (resharded on load) and
data position (a global sample index, `mgpu.data.sampler`), and its global rank 0 continues
the job's one MLflow run, where it logs what the change did, at the group's first step:

- `elastic/world_size`: the world size the group trains at;
- `elastic/restarts`: how many groups of the job ran before it (failures and membership
  changes alike);
- `elastic/seconds_lost`: wall time from the last step the job completed before the change
  to the first step completed after it (rendezvous, worker start, checkpoint load, that step);
- `elastic/steps_repeated`: the steps completed after the checkpoint it resumed from, which
  it trains again.

The groups of a job are recorded in `logs/groups.jsonl` of its output dir (one line each:
world size, run id, start time), where the next group finds the run to continue even before
any checkpoint names it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from mgpu import fault
from mgpu.errors import ConfigError
from mgpu.job import LaunchConf

GROUPS_FILE = "groups.jsonl"


@dataclass(frozen=True)
class Membership:
    """A worker group's place among its job's groups, and where the job stood when it began."""

    world_size: int
    restarts: int = 0  # groups of the job before this one
    last_step: int = 0  # the last step the job completed before this group, and when
    last_step_at: float | None = None

    def metrics(self, start_step: int, first_step_at: float) -> dict[str, float]:
        """What the group logs once its first step (after `start_step`, the checkpoint it
        resumed) completed at wall time `first_step_at`."""
        metrics = {"elastic/world_size": float(self.world_size),
                   "elastic/restarts": float(self.restarts)}
        if self.restarts and self.last_step_at is not None:
            metrics["elastic/seconds_lost"] = first_step_at - self.last_step_at
            metrics["elastic/steps_repeated"] = float(max(0, self.last_step - start_step))
        return metrics


def parse_nnodes(value: str) -> tuple[int, int]:
    """`launch.nnodes` as (min, max): "2" → (2, 2), "1:4" → (1, 4)."""
    try:
        lo, _, hi = str(value).partition(":")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"launch.nnodes={value}: use N or MIN:MAX with 1 <= MIN <= MAX")
    return bounds


def may_restart(launch: LaunchConf) -> bool:
    """Whether the agent may start another worker group of the job after this one ends: a
    node may join (MIN < MAX) or a failure may be retried (`launch.max_restarts`)."""
    low, high = parse_nnodes(launch.nnodes)
    return low < high or launch.max_restarts > 0


def groups_file(output_dir: str | Path) -> Path:
    return Path(output_dir, "logs", GROUPS_FILE)


def earlier_groups(output_dir: str | Path) -> list[dict]:
    """The job's worker groups so far, oldest first."""
    path = groups_file(output_dir)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def job_run(output_dir: str | Path) -> str | None:
    """The MLflow run the job's earlier groups logged into, where one did."""
    runs = [group["run_id"] for group in earlier_groups(output_dir) if group.get("run_id")]
    return runs[-1] if runs else None


def begin_group(output_dir: str | Path, world_size: int, run_id: str | None) -> Membership:
    """Global rank 0 of a new group: record the group and say where the job stood.

    Called before the group's first collective: the other ranks reset their step marks, from
    which the job's last completed step is read, only after it."""
    earlier = earlier_groups(output_dir)
    last = last_completed(output_dir) if earlier else None
    path = groups_file(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"world_size": world_size, "run_id": run_id,
                            "started_at": time.time()}) + "\n")
    return Membership(world_size, len(earlier), *(last or (0, None)))


def last_completed(output_dir: str | Path) -> tuple[int, float] | None:
    """(step, wall time) of the last step any rank of the job completed, from the ranks' step
    marks (`fault.StepMark`): a rank killed with its node leaves its mark behind."""
    marks = [fault.read_completed(path) for path in Path(output_dir, "logs").glob("rank*.step")]
    marks = [mark for mark in marks if mark is not None]
    return max(marks, key=lambda mark: mark[1]) if marks else None
