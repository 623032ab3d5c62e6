"""`make gpu-check`: the CUDA paths of mgpu in short real runs, then a table; under 5 minutes.

    python scripts/gpu_check.py            # exit 1 if a check failed; 0 without CUDA

One GPU: precision=amp (fp16 + GradScaler), bf16, fp32 with TF32, tensor-core padding, NVML
telemetry, the profiler with NVTX ranges, train/mfu, fsdp and tp (on two GPUs where there are,
else one-rank meshes), and two ranks sharing one GPU through gloo. Two GPUs or more add the
nccl paths: ddp with onebit and PowerSGD compression, zero1 with checkpoints, pp (bubble from
CUDA events), hybrid dp x tp on four, a rank killed and resumed from its checkpoint, and a hang
caught with NCCL's flight recorder. Each check is a `python -m mgpu` job of a few steps whose
summary.json (and files) are checked. Checks left when the time budget runs out are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 280  # the whole check stays under 5 minutes
QUICK = ["train.steps=30", "train.warmup_steps=10", "train.log_every=10", "eval.every_steps=0",
         "checkpoint.every_steps=0", "tracking.enabled=false"]
GPT = ["model=gpt", "optim=sgd", "optim.lr=0.05"]


class JobFailed(Exception):
    """A `python -m mgpu` job ended with a non-zero exit code."""


class GpuCheck:
    """Runs named checks in order within the time budget and keeps a row per check."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started = time.monotonic()
        self.rows: list[tuple[str, str, str]] = []
        self.jobs: dict[str, dict] = {}

    def check(self, name: str, body: Callable[[], str]) -> None:
        """Run `body` (asserts, returns the key figure) unless the time budget is spent."""
        if time.monotonic() - self.started > BUDGET_S:
            self.rows.append((name, "skip", "out of time"))
            return
        try:
            self.rows.append((name, "pass", body()))
        except Exception as e:  # a failed check is a row of the table, not the end of the run
            self.rows.append((name, "FAIL", f"{type(e).__name__}: {e}"[:160]))
        print(f"  {self.rows[-1][1]:<4}  {name}", flush=True)

    def skip(self, name: str, why: str) -> None:
        self.rows.append((name, "skip", why))

    def job(self, name: str, *overrides: str, expect_failure: bool = False) -> dict:
        """Summary of the job `name` (run once, with QUICK and `overrides`)."""
        if name not in self.jobs:
            out = self.out / name
            result = subprocess.run(
                [sys.executable, "-m", "mgpu", *QUICK, *overrides, f"hydra.run.dir={out}"],
                cwd=ROOT, capture_output=True, text=True, timeout=150,
                env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"},
            )
            if (result.returncode != 0) != expect_failure:
                lines = result.stderr.strip().splitlines() or [f"exit {result.returncode}"]
                raise JobFailed(lines[-1])
            summary_file = out / "summary.json"
            summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
            self.jobs[name] = {**summary, "_out": out, "_stderr": result.stderr}
        return self.jobs[name]

    def table(self) -> str:
        width = max(len(name) for name, _, _ in self.rows)
        lines = [f"{'check':<{width}}  result  key figure", f"{'-' * width}  ------  ----------"]
        lines += [f"{name:<{width}}  {status:<6}  {figure}" for name, status, figure in self.rows]
        return "\n".join(lines)

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for _, status, _ in self.rows)


def finite_loss(summary: dict) -> float:
    loss = summary["train/loss"]
    assert math.isfinite(loss) and loss < 2.5, f"train/loss {loss}"
    return loss


def rate(summary: dict) -> str:
    return f"{summary['train/samples_per_s']:,.0f} samples/s"


def one_gpu_checks(gc: GpuCheck, gpus: int) -> None:
    """On one GPU; fsdp and tp on two where there are (one-rank meshes otherwise)."""
    one = ["launch.nproc_per_node=1"]
    shard = [f"launch.nproc_per_node={min(gpus, 2)}"]
    amp = [*one, "precision=amp", "precision.pad_to_multiple_of=8", "monitor.enabled=true",
           "monitor.interval_s=0.2"]

    def amp_fp16() -> str:
        s = gc.job("amp", *amp)
        loss = finite_loss(s)
        assert s["amp/loss_scale"] > 0 and s["train/skipped_steps"] < 30
        return f"loss {loss:.3f}, scale {s['amp/loss_scale']:g}, {rate(s)}"

    def padding() -> str:
        s = gc.job("amp", *amp)
        weights = torch.load(s["_out"] / "model.pt", weights_only=True)
        assert tuple(weights["head.weight"].shape) == (10, 256), weights["head.weight"].shape
        return "head trained at 16 outputs, saved at 10"

    def telemetry() -> str:
        s = gc.job("amp", *amp)
        assert s["gpu/memory_used_bytes_max"] > 0 and s["gpu/power_w_mean"] > 0
        return f"util {s['gpu/util_mean']:.2f}, {s['gpu/power_w_mean']:.0f} W"

    def mfu() -> str:
        s = gc.job("amp", *amp)
        assert 0 < s["train/mfu"] < 1, s.get("train/mfu")
        return f"train/mfu {s['train/mfu']:.2e}"

    def bf16() -> str:
        assert torch.cuda.is_bf16_supported(), "this GPU has no bf16"
        s = gc.job("bf16", *one, "precision=bf16")
        assert "amp/loss_scale" not in s, "a loss scale logged without loss scaling"
        return f"loss {finite_loss(s):.3f}, {rate(s)}"

    profiled = [*one, "precision=fp32", "precision.tf32=true", "monitor.enabled=true",
                "monitor.profile=true", "monitor.profile_start_step=5", "monitor.profile_steps=2"]

    def tf32() -> str:
        s = gc.job("tf32", *profiled)
        return f"loss {finite_loss(s):.3f}, {rate(s)}"

    def profiler() -> str:
        s = gc.job("tf32", *profiled)
        trace = json.loads((s["_out"] / "profile" / "trace_rank0.json").read_text())
        events = trace["traceEvents"]
        kernels = [e for e in events if str(e.get("cat", "")).lower() == "kernel"]
        names = {e.get("name") for e in events}
        assert kernels, "no CUDA kernels in the trace"
        assert {"forward", "backward", "optimizer"} <= names, "phase ranges missing"
        return f"{len(kernels)} kernels, phases labelled"

    def fsdp() -> str:
        s = gc.job("fsdp", *shard, *GPT, "strategy=fsdp", "strategy.reshard_after_forward=false",
                   "strategy.cpu_offload=true", "strategy.activation_checkpointing=selective")
        return f"loss {finite_loss(s):.3f}, params/rank {s['memory/param_bytes_per_rank']:.0f} B"

    def tp() -> str:
        s = gc.job("tp", *shard, *GPT, "strategy=tp", "strategy.sequence_parallel=true")
        return f"loss {finite_loss(s):.3f}, {rate(s)}"

    def two_ranks_gloo() -> str:
        out = gc.out / "gloo"
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             __file__, "--gloo-worker", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=150, check=True,
        )
        s = json.loads((out / "summary.json").read_text())
        assert s["comm/bytes_per_step"] > 0
        return f"loss {finite_loss(s):.3f}, {s['comm/bytes_per_step']:.0f} B/step on the wire"

    gc.check("precision=amp (fp16 + GradScaler)", amp_fp16)
    gc.check("precision.pad_to_multiple_of=8", padding)
    gc.check("NVML telemetry (gpu/*)", telemetry)
    gc.check("train/mfu", mfu)
    gc.check("precision=bf16", bf16)
    gc.check("precision=fp32 with tf32", tf32)
    gc.check("profiler trace + NVTX ranges", profiler)
    gc.check("fsdp ZeRO-2, CPU offload, selective AC", fsdp)
    gc.check("tp + sequence parallel", tp)
    gc.check("2 ranks on one GPU through gloo", two_ranks_gloo)


def nccl_checks(gc: GpuCheck, gpus: int) -> None:
    two = ["launch.nproc_per_node=2"]

    def onebit() -> str:
        s = gc.job("onebit", *two, "compression=onebit", "compression.warmup_steps=2",
                   "monitor.enabled=true")
        ratio = s["comm/compression_ratio"]
        assert 0.95 * 32 < ratio <= 32, f"compression ratio {ratio} at 2 ranks"
        return f"ratio {ratio:.1f}, {s['comm/bandwidth_GBps']:.3g} GB/s, loss {finite_loss(s):.3f}"

    def powersgd() -> str:
        s = gc.job("powersgd", *two, "compression=powersgd", "compression.start_powerSGD_iter=2")
        assert s["comm/compression_ratio"] > 2
        return f"ratio {s['comm/compression_ratio']:.1f}, loss {finite_loss(s):.3f}"

    def zero1() -> str:
        s = gc.job("zero1", *two, "strategy=zero1", "checkpoint.every_steps=10")
        optimizer = s["memory/optimizer_bytes_per_rank"]
        return f"loss {finite_loss(s):.3f}, optimizer state/rank {optimizer:.0f} B"

    def pp() -> str:
        s = gc.job("pp", *two, *GPT, "strategy=pp")
        bubble = s["pp/bubble_fraction"]
        assert 0 < bubble < 1, bubble
        return f"bubble {bubble:.2f} (theory {s['pp/bubble_fraction_theory']:.2f})"

    def hybrid() -> str:
        s = gc.job("hybrid", "launch.nproc_per_node=4", *GPT, "strategy=hybrid", "strategy.dp=2",
                   "strategy.tp=2")
        return f"loss {finite_loss(s):.3f}, {rate(s)}"

    def resume() -> str:
        s = gc.job("resume", *two, "checkpoint.every_steps=10", "fault.mode=sigkill",
                   "fault.kill_rank=1", "fault.at_step=15", "launch.max_restarts=1")
        log = (s["_out"] / "logs" / "rank0.log").read_text()
        assert "resumed from" in log, "no resume in rank 0's log"
        return f"killed at 15, resumed from 10, loss {finite_loss(s):.3f}"

    def hang() -> str:
        s = gc.job("hang", *two, "fault.mode=hang", "fault.kill_rank=1", "fault.at_step=5",
                   "launch.timeout_s=20", expect_failure=True)
        dumps = sorted(p.name for p in (s["_out"] / "logs").glob("nccl_trace_rank_*"))
        assert "rank 1 hung" in s["_stderr"], "the failure does not name the hung rank"
        assert dumps, "no flight-recorder dumps"
        return f"named rank 1, {len(dumps)} flight-recorder dump(s)"

    gc.check("ddp + compression=onebit (nccl)", onebit)
    gc.check("ddp + compression=powersgd", powersgd)
    gc.check("zero1 + checkpoints", zero1)
    gc.check("pp, bubble from CUDA events", pp)
    if gpus >= 4:
        gc.check("hybrid dp=2 x tp=2", hybrid)
    else:
        gc.skip("hybrid dp=2 x tp=2", f"needs 4 GPUs, {gpus} present")
    gc.check("sigkill, restart, resume", resume)
    gc.check("hang: flight recorder, rank named", hang)


def gloo_worker(out: Path) -> None:
    """Under torchrun: this rank trains on cuda:0 with gloo, beside the other rank."""
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from mgpu.config import prepare
    from mgpu.runtime import Runtime, limit_cpu_threads, setup_logging, shutdown
    from mgpu.trainer import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[*QUICK, f"output_dir={out}"])
    job, options = prepare(cfg, cuda_devices=1, torchrun_world=(world, world))
    setup_logging(rank, out)
    limit_cpu_threads(world)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        runtime = Runtime(rank, rank, world, world, device, out)
        trainer = Trainer.build(job, runtime, None, options)
        summary = trainer.train()
        trainer.close()
        if rank == 0:
            (out / "summary.json").write_text(json.dumps(summary))
    finally:
        shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gloo-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_worker:
        gloo_worker(args.gloo_worker)
        return 0
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}): nothing to check")
        return 0
    gpus = torch.cuda.device_count()
    print(f"gpu_check: torch {torch.__version__}, {gpus} x {torch.cuda.get_device_name(0)}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="mgpu-gpu-check-") as tmp:
        gc = GpuCheck(Path(tmp))
        one_gpu_checks(gc, gpus)
        if gpus >= 2:
            nccl_checks(gc, gpus)
        else:
            gc.skip("nccl paths (ddp, zero1, pp, compression, resume, hang)", "needs 2 GPUs")
        print(gc.table())
        print(f"gpu_check: {time.monotonic() - gc.started:.0f} s")
    return 1 if gc.failed else 0


if __name__ == "__main__":
    sys.exit(main())
