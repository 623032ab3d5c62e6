"""A Prometheus exporter on every rank: live step, throughput, phase, comm and device series.

Rank r serves `http://<monitor.prometheus_host>:<monitor.prometheus_port + local rank>/metrics`
(127.0.0.1 unless told otherwise: the figures are for this machine's operator). Every series
carries a `rank` label, so one Prometheus job scraping all ports sees the whole group.
"""

from __future__ import annotations

import logging
import socket

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from mgpu.monitor.timing import PHASES

log = logging.getLogger(__name__)

# telemetry key → (series name, help, factor from the telemetry unit to the series unit)
DEVICE_SERIES = {
    "gpu/util": ("mgpu_gpu_utilization_ratio", "GPU SM utilisation (0-1)", 1.0),
    "gpu/memory_used_bytes": ("mgpu_gpu_memory_used_bytes", "GPU memory in use", 1.0),
    "gpu/temperature_c": ("mgpu_gpu_temperature_celsius", "GPU temperature", 1.0),
    "gpu/sm_clock_mhz": ("mgpu_gpu_sm_clock_hertz", "GPU SM clock", 1e6),
    "gpu/power_w": ("mgpu_gpu_power_watts", "GPU power draw", 1.0),
    "cpu/util_cores": ("mgpu_cpu_utilization_cores", "CPU cores busy in this rank", 1.0),
    "cpu/rss_bytes": ("mgpu_memory_rss_bytes", "resident memory of this rank", 1.0),
    "cpu/ram_used_ratio": ("mgpu_host_memory_used_ratio", "host RAM in use (0-1)", 1.0),
}


class Exporter:
    def __init__(self, host: str, port: int, rank: int) -> None:
        self.registry = CollectorRegistry()
        self.rank = str(rank)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, ["rank", *labels], registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["rank"], registry=self.registry)

        self.step = gauge("mgpu_step", "last completed optimizer step")
        self.step_duration = gauge(
            "mgpu_step_duration_seconds",
            "mean wall time per step since the last log point (log points, evaluation and "
            "checkpoints left out)")
        self.samples = counter("mgpu_samples", "training samples processed by this rank")
        self.loss = gauge("mgpu_loss", "training loss, mean over ranks and the last window")
        self.phase = gauge(
            "mgpu_phase_duration_seconds", "mean time per step in each phase", "phase")
        self.comm_seconds = gauge(
            "mgpu_allreduce_duration_seconds", "all-reduce time per step (sum over buckets)")
        self.comm_bytes = counter(
            "mgpu_comm_bytes", "bytes this rank put on the wire to synchronise gradients")
        self.device = {key: gauge(name, doc) for key, (name, doc, _) in DEVICE_SERIES.items()}
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("Prometheus exporter on http://%s:%d/metrics", host, port)

    def update_window(
        self, step: int, steps: int, samples: int, step_s: float | None, loss: float | None,
        phases: dict[str, float], comm_s: float | None, comm_bytes: float,
    ) -> None:
        """Figures of the window that ended at `step` (`steps` steps, `samples` samples)."""
        rank = self.rank
        self.step.labels(rank).set(step)
        self.samples.labels(rank).inc(samples)
        if step_s is not None:
            self.step_duration.labels(rank).set(step_s)
        if loss is not None:
            self.loss.labels(rank).set(loss)
        for name in PHASES:
            if name in phases:
                self.phase.labels(rank, name).set(phases[name])
        if comm_s is not None:
            self.comm_seconds.labels(rank).set(comm_s)
            self.comm_bytes.labels(rank).inc(comm_bytes)

    def update_device(self, values: dict[str, float]) -> None:
        """Called from the telemetry thread with each new sample."""
        for key, value in values.items():
            if key in self.device:
                self.device[key].labels(self.rank).set(value * DEVICE_SERIES[key][2])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 both free on `host`: `monitor.prometheus_port=p` for two local
    ranks, which serve on p and p + 1. For tests and benchmarks that scrape a 2-rank run; a
    port free now may be taken before the run binds it, so it is a good guess, not a lease."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind((host, 0))
            port = first.getsockname()[1]
            if port > 65000:  # keep p + 1 a valid port, away from the very top
                continue
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError(f"no two adjacent free ports on {host}")
