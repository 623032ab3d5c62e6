"""MLflow's own system metrics (`tracking.system_metrics`), sampled outside the training ranks.

The parent process only waits while its workers train, so it samples the machine (CPU, memory,
disk, network, and every GPU through NVML) and writes the `system/...` metrics there, where
its MLflow writes cannot compete with a training step. Under torchrun, rank 0 does it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mgpu.config import TrackingConf


@contextmanager
def system_metrics(
    tracking: TrackingConf, interval_s: float, run_id: str | None
) -> Iterator[None]:
    """Sample system metrics into the run every `interval_s` while the block runs (if
    `tracking.system_metrics` asks for it)."""
    if not (tracking.system_metrics and run_id):
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=interval_s, tracking_uri=tracking.uri,
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()
