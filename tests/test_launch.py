"""The parent's one line about a failed worker group: which rank, and what it said."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import mgpu.launch as launch_module
from mgpu.launch import describe_failure
from mgpu.model.mlp import MLP
from tests.conftest import launch_job, make_job


def error_file(output_dir: Path, local_rank: int, message: str) -> Path:
    """The error report a worker writes, where the elastic agent of this node keeps it."""
    attempt = output_dir / "logs" / "elastic" / "mgpu_x1" / "attempt_0"
    path = attempt / str(local_rank) / "error.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"message": {"message": f"Traceback ...\n{message}",
                                            "extraInfo": {"timestamp": "0"}}}))
    return path


def test_failure_on_the_second_node_names_the_global_rank_that_raised(tmp_path):
    """Node 1 of a 2 x 2 job runs global ranks 2 and 3 as local ranks 0 and 1. Rank 3 raised;
    rank 2 then lost its peer, and the agent saw rank 2 exit first."""
    job = make_job(["launch.nproc_per_node=2"], tmp_path)
    lost = error_file(tmp_path, 0, "RuntimeError: Connection reset by peer")
    error_file(tmp_path, 1, "ValueError: boom")
    error = ChildFailedError("mgpu", {2: ProcessFailure(0, 100, 1, str(lost))})
    assert describe_failure(error, job) == "rank 3 failed: ValueError: boom"


def test_hang_on_the_second_node_names_the_global_rank_that_never_came(tmp_path):
    """Rank 3 (local rank 1 of node 1) hung without a report; rank 2 timed out waiting."""
    job = make_job(["launch.nproc_per_node=2"], tmp_path)
    waited = error_file(tmp_path, 0, "RuntimeError: at step 5: DistBackendError: Timed out")
    error = ChildFailedError("mgpu", {2: ProcessFailure(0, 100, 1, str(waited))})
    assert describe_failure(error, job).startswith("rank 3 hung at step 5: ")


class FlightRecorderPathMLP(MLP):
    """The MLP, whose forward also leaves a mark where this worker's flight recorder would
    dump."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dump = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        if dump:
            Path(f"{dump}{os.environ['RANK']}.seen").write_text("")
        return super().forward(x)


@pytest.mark.dist
def test_each_job_of_a_process_gives_its_workers_its_own_flight_recorder_path(
        monkeypatch, tmp_path):
    """Two jobs launched one after the other from one process (a sweep), whose workers fork
    from one server started by the first: each job's ranks dump into that job's own logs, not
    into the first job's, and not nowhere (the server's environment is fixed at its start).
    The recorder is CUDA's; its paths are given here as on CUDA."""
    monkeypatch.setattr(launch_module, "flight_recorder_env", lambda output_dir: {
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(output_dir, "logs", "nccl_trace_rank_")})
    run = ["model._target_=tests.test_launch.FlightRecorderPathMLP", "train.steps=2",
           "train.warmup_steps=0", "eval.every_steps=0", "checkpoint.every_steps=0"]
    for name in ("first", "second"):
        launch_job(run, tmp_path / name)
    for name in ("first", "second"):
        marks = sorted(p.name for p in (tmp_path / name / "logs").glob("nccl_trace_rank_*"))
        assert marks == ["nccl_trace_rank_0.seen", "nccl_trace_rank_1.seen"], (name, marks)
