"""Thermal/clock-aware split: the throughput split, with each rank's speed blended with a
prediction from telemetry.

Measured step times lag behind a GPU that is about to throttle; telemetry leads. Each rank reads
its GPU through NVML: the SM clock as a fraction of its maximum (a throttled GPU runs slower in
proportion), reduced further as the temperature comes within `margin_c` degrees of the GPU's
slowdown threshold (where the clock will drop next). The ranks' predicted speeds are scaled to
the measured samples/s' total and blended with them: `telemetry_weight` x predicted +
(1 - weight) x measured. Each rank's fitted step time (fixed cost + cost per sample, see
`throughput.py`) is then divided by its blended speed over its measured one before the
equal-finish split is chosen: a rank expected to slow down is given less work before its
measurements show it. Without NVML or a GPU on some rank, it is `throughput`, said in one log
line.
"""

from __future__ import annotations

import logging

import pynvml
import torch

from mgpu.balance.throughput import Throughput
from mgpu.errors import ConfigError
from mgpu.nvml import device_handle
from mgpu.runtime import gather_rows

log = logging.getLogger(__name__)


def predicted_speed(device: torch.device, margin_c: float) -> float | None:
    """This GPU's expected relative speed now (1.0 = full clock, cool), or None without NVML."""
    if device.type != "cuda":
        return None
    try:
        handle = device_handle(device)
        clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        max_clock = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        temperature = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        slowdown = pynvml.nvmlDeviceGetTemperatureThreshold(
            handle, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    except pynvml.NVMLError:
        return None
    heat = min(1.0, max(0.0, (temperature - (slowdown - margin_c)) / margin_c)) if margin_c else 0
    return clock / max_clock * (1 - 0.5 * heat)  # at the threshold, expect half the clock


class Thermal(Throughput):
    def __init__(
        self,
        warmup_steps: int = 10,
        rebalance_every: int = 25,
        ema: float = 0.5,
        hysteresis: float = 0.05,
        telemetry_weight: float = 0.5,
        margin_c: float = 10.0,
    ) -> None:
        super().__init__(warmup_steps, rebalance_every, ema, hysteresis)
        if not 0 <= telemetry_weight <= 1:
            raise ConfigError(f"balance.telemetry_weight={telemetry_weight}: must be in [0, 1]")
        if margin_c < 0:
            raise ConfigError(f"balance.margin_c={margin_c}: must be >= 0")
        self.telemetry_weight, self.margin_c = telemetry_weight, margin_c
        self.fallback_logged = False

    def speeds(self, measured: torch.Tensor) -> torch.Tensor:
        """Each rank's blend of measured samples/s and telemetry, over the measured samples/s;
        1 for every rank where any rank has no telemetry."""
        own = predicted_speed(self.runtime.device, self.margin_c)
        predicted = gather_rows([float("nan") if own is None else own], self.runtime)[:, 0]
        if predicted.isnan().any():
            if not self.fallback_logged:
                log.info("balance=thermal: no NVML telemetry on rank(s) %s; splitting by "
                         "measured throughput alone", predicted.isnan().nonzero()[:, 0].tolist())
                self.fallback_logged = True
            return torch.ones_like(measured)
        scaled = predicted * measured.sum() / predicted.sum()
        blended = self.telemetry_weight * scaled + (1 - self.telemetry_weight) * measured
        return blended / measured
