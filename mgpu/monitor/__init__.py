"""Observability for one rank: the `monitor` section of the config, assembled in one object.

`Trainer` holds a `Monitor` and calls it at four points: on the DDP comm hook before `Trainer.build`
registers it (`monitor.timed(hook)`, to time it), around each phase of a step
(`monitor.timer.phase(name)`), after each step, and at log points, where every rank joins one
small all-reduce that gathers the window's figures so rank 0 can log min/mean/max across ranks
and name the slowest rank. With monitoring off (the default) the timer is a shared no-op
context and nothing else is built.

One module per concern: timing (phases), comm (hook wrapper), telemetry (NVML / CPU thread),
prometheus (one exporter per node), profiler (torch.profiler window), mfu (FLOPs against the
peak table).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np
from mlflow.tracking import MlflowClient

from mgpu.monitor.comm import CommMeter
from mgpu.monitor.mfu import MFU
from mgpu.monitor.profiler import StepProfiler
from mgpu.monitor.prometheus import Exporter, multiprocess_dir
from mgpu.monitor.telemetry import Telemetry
from mgpu.monitor.timing import PHASES, NullTimer, PhaseTimer
from mgpu.runtime import Runtime, gather_rows

if TYPE_CHECKING:
    from mgpu.compression import CommHook
    from mgpu.job import MonitorConf

log = logging.getLogger(__name__)

# Per-rank window figures gathered at log points, ahead of the telemetry keys.
WINDOW_KEYS = ("compute_before_comm", "allreduce")


class Monitor:
    def __init__(
        self, cfg: MonitorConf, runtime: Runtime, run_id: str | None, tracking_uri: str,
        warmup_steps: int, mfu: MFU | None,
    ) -> None:
        """The `monitor` section's parts for this rank: `mfu` where the run's model and
        device have one (`MFU.for_run`), the first `warmup_steps` steps this process runs
        (after a resume too) left out of the phase figures."""
        self.runtime, self.run_id, self.uri = runtime, run_id, tracking_uri
        self.enabled = cfg.enabled
        # An exporter's series need the phases, the comm timing and the telemetry: asking for
        # a port turns them on (without their MLflow metrics, which `enabled` adds).
        self.measuring = cfg.enabled or cfg.prometheus_port is not None
        multi_rank = runtime.world_size > 1
        self.comm = CommMeter(runtime.device) if self.measuring and multi_rank else None
        self.timer: PhaseTimer | NullTimer = (
            PhaseTimer(runtime.device, warmup_steps, self.comm)
            if self.measuring else NullTimer()
        )
        self.telemetry = Telemetry(runtime.device, cfg.interval_s) if self.measuring else None
        self.mfu = mfu if self.enabled else None
        self.exporter = None
        if cfg.prometheus_port is not None:
            self.exporter = Exporter(
                cfg.prometheus_host, cfg.prometheus_port, runtime.rank,
                multiprocess_dir(runtime.output_dir), serve=runtime.local_rank == 0)
            if self.telemetry:
                self.telemetry.listeners.append(self.exporter.update_device)
        self.profiler = None
        if cfg.profile:
            trace = runtime.output_dir / "profile" / f"trace_rank{runtime.rank}.json"
            self.profiler = StepProfiler(
                runtime.device, cfg.profile_start_step, cfg.profile_steps, trace)
        if self.telemetry:
            self.telemetry.start()
        self.window_steps = 0
        self.window_samples = 0  # this rank's samples since the last log point

    def timed(self, hook: CommHook | None) -> CommHook | None:
        """The DDP comm hook to register: `hook` (None: DDP's built-in all-reduce) as it is
        when communication is not timed, else wrapped to time its collectives."""
        return self.comm.timed(hook) if self.comm else hook

    def end_step(self, step: int, samples: int) -> None:
        """Step `step` ended, in which this rank took `samples` samples (a balance may change
        its share from step to step)."""
        self.window_samples += samples
        if self.measuring:
            self.timer.end_step(step)
        if self.profiler:
            recording = self.profiler.after_step(step)
            if self.measuring:
                self.timer.annotate = recording
        self.window_steps += 1

    def log_point(
        self, step: int, metrics: dict[str, float], step_s: float | None
    ) -> dict[str, float]:
        """The window's figures; every rank must call it (it holds one all-reduce when enabled).

        `metrics` are this rank's figures of the window (loss, throughput, the compression's
        bytes on the wire); `step_s` its mean step time, stalls left out. Returns the metrics
        rank 0 logs (an empty dict on other ranks, or when monitoring is off).
        """
        window = self.timer.collect() if self.measuring else []
        if self.exporter:
            self.export(step, step_s, metrics, window)
        self.window_steps = self.window_samples = 0
        if not self.enabled:
            return {}
        local = [
            float(np.mean([w[key] for w in window])) if window else math.nan
            for key in WINDOW_KEYS
        ] + self.telemetry.window()
        table = gather_rows(local, self.runtime).numpy()
        if not self.runtime.is_main:
            return {}
        out = self.timer.percentiles()
        out.update(self.across_ranks(table, metrics.get("comm/bytes_per_step")))
        if self.mfu and "train/samples_per_s" in metrics:
            out["train/mfu"] = self.mfu(metrics["train/samples_per_s"])
        return out

    def across_ranks(self, table: np.ndarray, wire_bytes: float | None) -> dict[str, float]:
        """Stragglers, communication and telemetry of the window, from the gathered table.

        `comm/allreduce_s` is the wall time per step during which at least one of the hook's
        collectives was in flight (launch to completion, overlapping buckets counted once),
        mean over ranks. `wire_bytes` is what the compression counted on the wire per step
        (None where it counts nothing): the bandwidth divides those bytes, not the gradient
        bytes the hook was handed, by that time, so it is the rate at which the step's
        gradients crossed the wire while any of them did.
        """
        compute, allreduce = table[:, 0], table[:, 1]
        out = {}
        if not np.isnan(compute).all():
            out["time/slowest_rank"] = float(np.nanargmax(compute))
            out["time/compute_before_comm_max_s"] = float(np.nanmax(compute))
            out["time/compute_before_comm_min_s"] = float(np.nanmin(compute))
        if self.comm and np.nanmean(allreduce) > 0:
            out["comm/allreduce_s"] = float(np.nanmean(allreduce))
            if wire_bytes:
                out["comm/bandwidth_GBps"] = wire_bytes / out["comm/allreduce_s"] / 1e9
        for i, key in enumerate(self.telemetry.keys, start=len(WINDOW_KEYS)):
            column = table[:, i]
            if not np.isnan(column).all():
                out[f"{key}_min"] = float(np.nanmin(column))
                out[f"{key}_mean"] = float(np.nanmean(column))
                out[f"{key}_max"] = float(np.nanmax(column))
        return out

    def export(
        self, step: int, step_s: float | None, metrics: dict[str, float], window: list[dict]
    ) -> None:
        phases = {p: float(np.mean([w[p] for w in window])) for p in PHASES} if window else {}
        comm_s = float(np.mean([w["allreduce"] for w in window])) if window and self.comm else None
        comm_bytes = metrics.get("comm/bytes_per_step", 0.0) * self.window_steps
        self.exporter.update_window(
            step, self.window_steps, self.window_samples, step_s,
            metrics.get("train/loss"), phases, comm_s, comm_bytes,
        )

    def close(self) -> None:
        """Stop the threads and the exporter; log this rank's profiler trace to the run."""
        if self.telemetry:
            self.telemetry.stop()
        if self.exporter:
            self.exporter.close()
        if self.profiler:
            self.profiler.close()
        if self.profiler and self.profiler.written and self.run_id:
            try:
                MlflowClient(self.uri).log_artifact(
                    self.run_id, str(self.profiler.path), artifact_path="profile")
            except Exception as e:  # tracking trouble must not fail a finished run
                log.warning("could not log the profiler trace to MLflow: %s", e)
