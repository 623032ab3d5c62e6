"""strategy=auto: not a layout of its own but the choice of one, made in the parent before any
worker starts.

`mgpu.plan` predicts every layout the rules allow at the world size (memory per rank, step
time); auto takes the fastest predicted layout that fits `memory_limit`, or, with `trials` > 0,
times the top `trials` of them for `trial_steps` steps each (MLflow child runs of the job's run,
tagged `mgpu.trial`) and takes the fastest measured. The job then runs with the chosen
strategy's own node: workers, the support rules and the run's params only ever see a concrete
strategy (`resolve`). The plan table is logged as an artifact, the choice as tags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pynvml
import torch

from mgpu.errors import ConfigError
from mgpu.nvml import device_handle
from mgpu.options import Options
from mgpu.plan.machine import Machine, measure
from mgpu.plan.planner import Row, plan_job, smallest

if TYPE_CHECKING:
    from mgpu.job import Job


@dataclass(frozen=True)
class Planned:
    """What auto decided in the parent, for the trials and the run's record."""

    auto: Auto
    rows: list[Row]
    machine: Machine
    memory_limit: float


class Auto:
    #: Replaced by the layout it plans before any rule or worker sees the job.
    planned = True
    world_size = None

    def __init__(
        self,
        trials: int = 0,
        trial_steps: int = 8,
        memory_limit: int | None = None,
        cpu_memory_budget: int = 4 * 2**30,
    ) -> None:
        if trials < 0:
            raise ConfigError(f"strategy.trials={trials}: must be >= 0 (0 = plan only)")
        if trial_steps < 2:
            raise ConfigError(f"strategy.trial_steps={trial_steps}: must be >= 2 (the first "
                              f"step is warm-up)")
        if memory_limit is not None and memory_limit <= 0:
            raise ConfigError(f"strategy.memory_limit={memory_limit}: bytes per rank > 0, or "
                              f"null for the device's free memory")
        if cpu_memory_budget <= 0:
            raise ConfigError(f"strategy.cpu_memory_budget={cpu_memory_budget}: must be > 0")
        self.trials, self.trial_steps = trials, trial_steps
        self.memory_limit, self.cpu_memory_budget = memory_limit, cpu_memory_budget

    def limit(self, device: torch.device) -> float:
        """Bytes per rank a layout may need: memory_limit, else the GPU's free memory, else
        the stated CPU budget."""
        if self.memory_limit is not None:
            return float(self.memory_limit)
        if device.type == "cuda":  # NVML's figure: torch's would open a context in the parent
            return float(pynvml.nvmlDeviceGetMemoryInfo(device_handle(device)).free)
        return float(self.cpu_memory_budget)

    def resolve(self, job: Job, options: Options, cuda_devices: int,
                torchrun: bool) -> tuple[Job, Options]:
        """The job with the fastest predicted layout that fits as its strategy, and its options
        (holding what was planned, `Options.planned`)."""
        if torchrun or job.launch.nnodes != "1":
            raise ConfigError(
                "strategy=auto plans in the one parent process of a single-node launch; under "
                "torchrun or several nodes each would plan alone: print the plan with "
                "`python -m mgpu.plan ...` and pass its first strategy"
            )
        device = torch.device("cuda", 0) if cuda_devices else torch.device("cpu")
        world = job.launch.world_size
        batch = max(1, job.data["batch_size"] // world // job.train.grad_accum)
        machine = measure(options, batch, world, device)
        limit = self.limit(device)
        rows = plan_job(job, options, machine, limit)
        if not rows:
            raise ConfigError(f"strategy=auto: no layout of {world} ranks passes the support "
                              f"rules with these options; name a strategy")
        if not rows[0].fits:
            raise ConfigError(no_fit_message(self.memory_limit, limit, world, smallest(rows)))
        return with_strategy(job, rows[0].candidate.node,
                             Planned(self, rows, machine, limit))


def no_fit_message(setting: int | None, limit: float, world: int, least: Row) -> str:
    """One line: the limit, and what the smallest layout needs."""
    return (
        f"strategy.memory_limit={setting if setting is not None else 'null'}: no layout of "
        f"{world} ranks fits {limit:,.0f} bytes per rank; the smallest, "
        f"{least.candidate.name}, needs {least.memory.device:,.0f} bytes per rank; raise "
        f"strategy.memory_limit, use more ranks or a smaller model"
    )


def with_strategy(job: Job, node: dict[str, Any], planned: Planned | None) -> tuple[Job, Any]:
    """`job` running the strategy `node`, and its options rebuilt around it."""
    job = dataclasses.replace(job, strategy=node)
    return job, dataclasses.replace(Options.of(job.groups()), planned=planned)
