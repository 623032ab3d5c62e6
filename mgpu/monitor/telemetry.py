"""Device telemetry sampled in a background thread: the GPU through NVML, else CPU and RAM.

Every rank samples its own GPU (SM utilisation, memory used, temperature, SM clock, power)
and its own process (CPU, resident memory) every `interval_s`. At a log point each rank hands
over the mean of its samples since the last one; `Monitor` gathers them across ranks.
Without NVML (no driver, a CPU run) the GPU figures are simply absent.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import psutil
import torch

log = logging.getLogger(__name__)

CPU_KEYS = ("cpu/util_cores", "cpu/rss_bytes", "cpu/ram_used_ratio")
GPU_KEYS = (
    "gpu/util", "gpu/memory_used_bytes", "gpu/temperature_c", "gpu/sm_clock_mhz", "gpu/power_w",
)


def nvml_reader(device: torch.device) -> Callable[[], dict[str, float]] | None:
    """A function reading this rank's GPU through NVML, or None where NVML is not available."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        from mgpu.nvml import device_handle

        handle = device_handle(device)
    except Exception as e:  # no driver library, no permission, ...: telemetry degrades
        log.warning("NVML not available (%s): GPU telemetry off, CPU and RAM only", e)
        return None

    def read() -> dict[str, float]:
        return {
            "gpu/util": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100,
            "gpu/memory_used_bytes": float(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
            "gpu/temperature_c": float(
                pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            "gpu/sm_clock_mhz": float(
                pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "gpu/power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,
        }

    return read


class Telemetry:
    """Samples in a daemon thread; `window()` returns the means since the previous call."""

    def __init__(self, device: torch.device, interval_s: float) -> None:
        self.keys = CPU_KEYS + (GPU_KEYS if device.type == "cuda" else ())
        self.gpu = nvml_reader(device)
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first call only starts the measurement
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.samples: list[dict[str, float]] = []
        self.latest: dict[str, float] = {}
        self.listeners: list[Callable[[dict[str, float]], None]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="mgpu-telemetry", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def sample(self) -> dict[str, float]:
        values = {
            "cpu/util_cores": self.process.cpu_percent(None) / 100,
            "cpu/rss_bytes": float(self.process.memory_info().rss),
            "cpu/ram_used_ratio": psutil.virtual_memory().percent / 100,
        }
        if self.gpu:
            try:
                values.update(self.gpu())
            except Exception as e:
                log.warning("NVML read failed (%s): GPU telemetry off", e)
                self.gpu = None
        return values

    def _loop(self) -> None:
        while True:  # a first sample at once, then one per interval
            values = self.sample()
            with self.lock:
                self.samples.append(values)
                self.latest = values
            for listener in self.listeners:
                listener(values)
            if self.stopped.wait(self.interval_s):
                return

    def window(self) -> list[float]:
        """Mean of each key over the samples since the last call (NaN where none was taken)."""
        with self.lock:
            samples, self.samples = self.samples, []
            if not samples and self.latest:
                samples = [self.latest]  # log points closer together than the interval
        means = []
        for key in self.keys:
            values = [s[key] for s in samples if key in s]
            means.append(sum(values) / len(values) if values else math.nan)
        return means

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=self.interval_s + 1)
