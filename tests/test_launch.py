"""The parent's one line about a failed worker group: which rank, and what it said."""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from mgpu.launch import describe_failure
from tests.conftest import make_job


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
