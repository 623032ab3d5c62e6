"""`make bench`: benchmarks run side by side in one invocation; writes a JSON report.

Every figure that matters is a ratio of runs measured in the same invocation, interleaved
round by round, so machine noise hits both sides alike. Each section is a function below,
listed in SECTIONS; `--only NAME` runs one.
"""

from __future__ import annotations

import argparse
import csv
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


def bench_precision(rounds: int, workdir: Path) -> dict:
    """fp32 vs bf16 vs amp (fp16 + GradScaler) under strategy=ddp: samples/s and eval accuracy.

    On CPU, bf16/fp16 autocast mostly adds casts (no tensor cores): the ratios say what the
    precision costs here; on GPUs they say what it gains.
    """
    steps, warmup = 600, 50
    common = [f"train.steps={steps}", f"train.warmup_steps={warmup}", "train.log_every=100",
              "eval.every_steps=0", "strategy=ddp"]
    names = ("fp32", "bf16", "amp")
    rate = {name: [] for name in names}
    accuracy = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            summary = run_mgpu([*common, f"precision={name}"], workdir)
            rate[name].append(summary["train/samples_per_s"])
            accuracy[name].append(summary["eval/accuracy"])
    median = {name: statistics.median(values) for name, values in rate.items()}
    return {
        "samples_per_s_median": median,
        "samples_per_s_rounds": rate,
        "eval_accuracy_rounds": accuracy,
        "ratio_to_fp32": {name: median[name] / median["fp32"] for name in names},
        "setup": f"MLP 64-256-256-10 on digits, global batch 64, {steps} steps "
                 f"({warmup} warm-up), AdamW cosine, 2 gloo processes",
    }


SECTIONS = {"overhead": bench_overhead, "precision": bench_precision}
def bench_commbench(rounds: int, workdir: Path) -> dict:
    """task=commbench on 2 gloo processes: bus bandwidth and latency per op and message size.

    Figures of this machine's gloo (medians over rounds), not a ratio: a reference for what a
    CPU run's communication costs, and for comparing network settings on a real fabric.
    """
    max_bytes = 4 * 2**20
    tables = []
    for i in range(rounds):
        out = workdir / f"commbench{i}"
        subprocess.run(
            [sys.executable, "-m", "mgpu", "task=commbench", f"task.max_bytes={max_bytes}",
             "tracking.enabled=false", f"hydra.run.dir={out}"],
            cwd=workdir, check=True, capture_output=True, text=True,
        )
        with open(out / "commbench.csv") as f:
            tables.append(list(csv.DictReader(f)))
    figures: dict[str, dict[str, dict[str, float]]] = {"busbw_GBps": {}, "latency_s": {}}
    for row_index, row in enumerate(tables[0]):
        for name, by_op in figures.items():
            values = [float(table[row_index][name]) for table in tables]
            by_op.setdefault(row["op"], {})[row["size_bytes"]] = statistics.median(values)
    return {
        "busbw_GBps_median": figures["busbw_GBps"],
        "latency_s_median": figures["latency_s"],
        "setup": f"python -m mgpu task=commbench task.max_bytes={max_bytes}: 1 KiB - 4 MiB "
                 "float32, 5 warm-up + 20 timed calls per size, 2 gloo processes",
    }


STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp"],
    "zero1": ["strategy=zero1"],
    "fsdp": ["strategy=fsdp"],
    "tp": ["strategy=tp"],
    "pp_gpipe": ["strategy=pp", "strategy.schedule=gpipe"],
    "pp_1f1b": ["strategy=pp", "strategy.schedule=1f1b"],
    "pp_interleaved_1f1b": ["strategy=pp", "strategy.schedule=interleaved_1f1b"],
    "hybrid_dp2_tp2": ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2"],
    "hybrid_dp2_pp2": ["strategy=hybrid", "strategy.dp=2", "strategy.pp=2"],
}


def bench_strategies(rounds: int, workdir: Path) -> dict:
    """Every strategy on model=gpt: throughput, bytes per rank, pipeline bubble (measured and
    the schedule's (p-1)/(v*m+p-1)). 2 processes, 4 for hybrid; SGD so state is one buffer."""
    steps, warmup = 60, 10
    common = ["model=gpt", "optim=sgd", f"train.steps={steps}", f"train.warmup_steps={warmup}",
              "train.log_every=10", "eval.every_steps=0", "optim.schedule=constant"]
    keep = ("train/samples_per_s", "memory/param_bytes_per_rank",
            "memory/optimizer_bytes_per_rank", "memory/peak_bytes", "pp/bubble_fraction",
            "pp/bubble_fraction_theory", "eval/accuracy")
    samples: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    figures: dict[str, dict] = {}
    for _ in range(rounds):
        for name, overrides in STRATEGIES.items():
            summary = run_mgpu([*common, *overrides], workdir)
            samples[name].append(summary["train/samples_per_s"])
            figures[name] = {key: summary[key] for key in keep if key in summary}
    for name, values in samples.items():
        figures[name]["train/samples_per_s"] = statistics.median(values)
    ddp = figures["ddp"]["train/samples_per_s"]
    return {
        "per_strategy": figures,
        "samples_per_s_rounds": samples,
        "throughput_vs_ddp": {n: f["train/samples_per_s"] / ddp for n, f in figures.items()},
        "setup": f"model=gpt (dim 64, 4 heads, 4 blocks) on digits as 64-token sequences, "
                 f"global batch 64, {steps} steps ({warmup} warm-up), SGD, gloo",
    }


SECTIONS = {
    "overhead": bench_overhead,
    "precision": bench_precision,
    "commbench": bench_commbench,
    "strategies": bench_strategies,
}


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
