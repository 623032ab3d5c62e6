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


def bench_straggler(rounds: int, workdir: Path) -> dict:
    """Simulated stragglers, side by side: how much of the lost throughput balance wins back.

    - slowdown: rank 1's compute takes 2x as long; balance=none vs throughput (target >= 1.4;
      the ideal for 2 ranks is 1.5: 3 units of work per 2 time units instead of per 2 x 1).
    - jitter: every rank sleeps a random (exponential, mean 10 ms) time per step; balance=none
      vs ssp with staleness 2 (target >= 1.2).
    Final eval accuracy of every run is reported: balancing must not cost accuracy (1 point).
    """
    steps = ["train.steps=300", "train.warmup_steps=60", "train.log_every=100",
             "eval.every_steps=0", "optim.schedule=constant"]
    scenarios = {
        "slowdown": (["straggler.slowdown=[1.0,2.0]", "model.hidden=[512,512]",
                      "data.batch_size=128"],
                     {"none": ["balance=none"],
                      "throughput": ["balance=throughput", "balance.warmup_steps=10"]}),
        "jitter": (["straggler.jitter_s=0.01"],
                   {"none": ["balance=none"], "ssp": ["balance=ssp", "balance.staleness=2"]}),
    }
    rates = {f"{s}/{o}": [] for s, (_, options) in scenarios.items() for o in options}
    accuracy = {name: [] for name in rates}
    for _ in range(rounds):
        for scenario, (common, options) in scenarios.items():
            for option, overrides in options.items():
                summary = run_mgpu([*steps, *common, *overrides], workdir)
                rates[f"{scenario}/{option}"].append(summary["train/samples_per_s"])
                accuracy[f"{scenario}/{option}"].append(summary["eval/accuracy"])
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "samples_per_s_median": median,
        "samples_per_s_rounds": rates,
        "eval_accuracy_rounds": accuracy,
        "ratio_throughput_to_none": median["slowdown/throughput"] / median["slowdown/none"],
        "target_ratio_throughput": 1.4,
        "ratio_ssp_to_none": median["jitter/ssp"] / median["jitter/none"],
        "target_ratio_ssp": 1.2,
        "setup": "2 gloo processes, 300 steps (60 warm-up), AdamW constant lr; slowdown: MLP "
                 "64-512-512-10, global batch 128, rank 1 slowed 2x; jitter: MLP 64-256-256-10, "
                 "global batch 64, exponential jitter mean 10 ms per step and rank",
    }


SECTIONS = {"overhead": bench_overhead, "straggler": bench_straggler}


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
