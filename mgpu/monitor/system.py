"""MLflow's own system metrics (`tracking.system_metrics`), sampled outside the training ranks.

The parent process only waits while its workers train, so it samples the machine (CPU, memory,
disk, network, and every GPU through NVML) and writes the `system/...` metrics there, where
its MLflow writes cannot compete with a training step. Under torchrun, rank 0 does it, and on a
job of several nodes each node's local rank 0 samples its own machine, under its node id
(`system/node1/cpu_utilization_percentage`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mgpu.job import TrackingConf


@contextmanager
def system_metrics(
    tracking: TrackingConf, interval_s: float, run_id: str | None, node_id: str | None = None
) -> Iterator[None]:
    """Sample system metrics into the run every `interval_s` while the block runs (if
    `tracking.system_metrics` asks for it), under `node_id` where one is given."""
    if not (tracking.system_metrics and run_id):
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=interval_s, tracking_uri=tracking.uri, node_id=node_id,
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def node_id() -> str | None:
    """`node<N>` (N: this node's rank in the job, torchelastic's GROUP_RANK) in a worker of a
    job that spans several nodes, else None: one machine's metrics need no node id."""
    if int(os.environ.get("WORLD_SIZE", 1)) > int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        return f"node{os.environ['GROUP_RANK']}"
    return None
