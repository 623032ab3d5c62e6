"""`make bench`: benchmarks run side by side in one invocation; writes a JSON report.

Every figure that matters is a ratio of runs measured in the same invocation, interleaved
round by round, so machine noise hits both sides alike. Each section is a function below,
listed in SECTIONS; `--only NAME` runs one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_mgpu(overrides: list[str], workdir: Path) -> dict:
    """One `python -m mgpu` run (tracking into a store in `workdir`); returns its summary."""
    out = workdir / f"run{time.monotonic_ns()}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}"}
    subprocess.run(
        [sys.executable, "-m", "mgpu", *overrides, f"hydra.run.dir={out}"],
        cwd=workdir, env=env, check=True, capture_output=True, text=True,
    )
    return json.loads((out / "summary.json").read_text())


def run_plain_ddp(steps: int, warmup: int, nproc: int = 2) -> dict:
    """The hand-written torchrun DDP baseline (scripts/plain_ddp.py); returns its JSON line."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", str(ROOT / "scripts" / "plain_ddp.py"),
         f"--steps={steps}", f"--warmup={warmup}"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_overhead(rounds: int, workdir: Path) -> dict:
    """mgpu strategy=ddp vs a plain DDP script vs mgpu strategy=single (same model, data, steps).

    Target: mgpu ddp / plain >= 0.99, i.e. mgpu adds nothing measurable to the step.
    """
    steps, warmup = 2000, 100
    common = [f"train.steps={steps}", f"train.warmup_steps={warmup}", "train.log_every=100",
              "eval.every_steps=0", "optim.schedule=constant"]
    samples = {"mgpu_ddp": [], "plain_ddp": [], "mgpu_single": []}
    for _ in range(rounds):
        samples["plain_ddp"].append(run_plain_ddp(steps, warmup)["samples_per_s"])
        samples["mgpu_ddp"].append(
            run_mgpu([*common, "strategy=ddp"], workdir)["train/samples_per_s"])
        samples["mgpu_single"].append(
            run_mgpu([*common, "strategy=single"], workdir)["train/samples_per_s"])
    median = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "samples_per_s_median": median,
        "samples_per_s_rounds": samples,
        "ratio_mgpu_ddp_to_plain": median["mgpu_ddp"] / median["plain_ddp"],
        "target_ratio": 0.99,
        "setup": f"MLP 64-256-256-10 on digits, global batch 64, {steps} steps "
                 f"({warmup} warm-up), AdamW constant lr, 2 gloo processes",
    }


COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "onebit")


def bench_compression(rounds: int, workdir: Path) -> dict:
    """Each compression on strategy=ddp, 2 processes, the default run (500 steps): bytes this
    rank hands to collectives per step and the ratio to plain fp32 (both from the last log
    window, after every warm-up), samples/s and final accuracy, side by side."""
    common = ["strategy=ddp", "eval.every_steps=0"]
    runs = {name: [] for name in COMPRESSIONS}
    for _ in range(rounds):
        for name in COMPRESSIONS:
            runs[name].append(run_mgpu([*common, f"compression={name}"], workdir))
    report = {}
    for name, summaries in runs.items():
        rates = [s["train/samples_per_s"] for s in summaries]
        report[name] = {
            "comm/bytes_per_step": summaries[-1]["comm/bytes_per_step"],
            "comm/compression_ratio": summaries[-1]["comm/compression_ratio"],
            "samples_per_s_median": statistics.median(rates),
            "samples_per_s_rounds": rates,
            "eval/accuracy": [s["eval/accuracy"] for s in summaries],
        }
    baseline = report["none"]["samples_per_s_median"]
    for name in COMPRESSIONS:
        report[name]["samples_per_s_vs_none"] = report[name]["samples_per_s_median"] / baseline
    report["setup"] = ("MLP 64-256-256-10 on digits (one DDP bucket, 340 kB), global batch 64, "
                       "500 steps, AdamW cosine, 2 gloo processes; bytes: what one rank hands "
                       "to all_reduce / all_gather per optimizer step")
    return report


SECTIONS = {"overhead": bench_overhead, "compression": bench_compression}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-report.json")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    args = parser.parse_args()
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.cuda.is_available()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or SECTIONS:
            print(f"bench: {name} ...", flush=True)
            started = time.perf_counter()
            report[name] = SECTIONS[name](args.rounds, Path(tmp))
            report[name]["wall_s"] = round(time.perf_counter() - started, 1)
            print(json.dumps({name: report[name]}, indent=2), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"bench: report written to {args.out}")


if __name__ == "__main__":
    main()
