"""`make bench`: benchmarks run side by side in one invocation; writes a JSON report.

Every figure that matters is a ratio of runs measured in the same invocation, interleaved
round by round, so machine noise hits both sides alike. Each section is a function below,
listed in SECTIONS; `--only NAME` runs one.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil
import torch

from mgpu.monitor.prometheus import free_port

ROOT = Path(__file__).resolve().parents[1]


def run_mgpu(overrides: list[str], workdir: Path) -> dict:
    """One `python -m mgpu` run (tracking into a store in `workdir`); returns its summary."""
    out = workdir / f"run{time.monotonic_ns()}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}"}
    subprocess.run(
        [sys.executable, "-m", "mgpu", *overrides, f"hydra.run.dir={out}"],
        cwd=workdir, env=env, check=True, capture_output=True, text=True,
    )
    return {**json.loads((out / "summary.json").read_text()), "output_dir": out}


def run_peer(script: str, steps: int, warmup: int, nproc: int = 2) -> dict:
    """A peer training script (scripts/<script>) under torchrun; returns its JSON line."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", str(ROOT / "scripts" / script),
         f"--steps={steps}", f"--warmup={warmup}"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def wait_for_quiet(busy_below: float = 0.15, max_wait_s: float = 120.0) -> dict:
    """Wait until the machine's CPU is less than `busy_below` busy over 2 s (at most
    `max_wait_s`); returns what was seen, so a round that ran contended says so."""
    started = time.perf_counter()
    while True:
        busy = psutil.cpu_percent(interval=2.0) / 100
        waited = time.perf_counter() - started
        if busy < busy_below or waited >= max_wait_s:
            return {"busy_before": round(busy, 3), "waited_s": round(waited, 1),
                    "load_average": os.getloadavg()[0]}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def bench_overhead(rounds: int, workdir: Path) -> dict:
    """mgpu strategy=ddp vs its peers on one job: a hand-written DDP script and the same
    script under HuggingFace Accelerate (skipped, and said so, where `accelerate` is not
    installed: `pip install -e '.[bench]'`), and mgpu strategy=single. Rounds interleave all
    of them, so noise hits each alike; the ratios are of medians. Also the cost of each guard
    mgpu adds to the step, timed on its own (`guards`).

    Targets: mgpu / plain >= 1.05 (and >= 0.99 with nothing but what the plain loop does),
    mgpu / Accelerate >= 1.15.
    """
    steps, warmup = 2000, 100
    common = [f"train.steps={steps}", f"train.warmup_steps={warmup}", "train.log_every=100",
              "eval.every_steps=0", "optim.schedule=constant",
              "checkpoint.every_steps=0"]  # the peers save nothing either
    runs = {
        "plain_ddp": lambda: run_peer("plain_ddp.py", steps, warmup),
        "accelerate_ddp": lambda: run_peer("accelerate_ddp.py", steps, warmup),
        "mgpu_ddp": lambda: run_mgpu([*common, "strategy=ddp"], workdir),
        "mgpu_single": lambda: run_mgpu([*common, "strategy=single"], workdir),
    }
    skipped = {}
    if not installed("accelerate"):
        skipped["accelerate_ddp"] = "accelerate is not installed: pip install -e '.[bench]'"
        print(f"bench: overhead: accelerate_ddp skipped ({skipped['accelerate_ddp']})")
        del runs["accelerate_ddp"]
    samples = {name: [] for name in runs}
    quiet, contention = [], []
    for _ in range(rounds):
        quiet.append(wait_for_quiet())
        for name, run in runs.items():
            result = run()
            samples[name].append(result.get("samples_per_s") or result["train/samples_per_s"])
            if name == "mgpu_ddp":  # the machine's other load while the run was timed
                contention.append(result.get("host/other_cpu_fraction"))
    median = {name: statistics.median(values) for name, values in samples.items()}
    report = {
        "samples_per_s_median": median,
        "samples_per_s_rounds": samples,
        "machine_before_each_round": quiet,
        "mgpu_ddp_other_cpu_fraction_per_round": contention,
        "ratio_mgpu_ddp_to_plain": median["mgpu_ddp"] / median["plain_ddp"],
        "target_ratio_to_plain": 1.05,
        "guards": guard_costs(),
        "skipped": skipped,
        "setup": f"MLP 64-256-256-10 on digits, global batch 64 (32 per process), {steps} steps "
                 f"({warmup} warm-up, left out of the figure), AdamW lr 2e-3 weight decay 0.01 "
                 f"constant, seed 0, 2 gloo processes, the same for every peer",
    }
    if "accelerate_ddp" in median:
        report["ratio_mgpu_ddp_to_accelerate"] = median["mgpu_ddp"] / median["accelerate_ddp"]
        report["target_ratio_to_accelerate"] = 1.15
    return report


def guard_costs(calls: int = 2000) -> dict:
    """Microseconds per step of each check mgpu adds to a step that a plain loop does not
    make, on the overhead job's model and batch (one process, measured in-process): the
    non-finite loss seed and gradient check, and the step meter's record."""
    import torch.nn.functional as F

    from mgpu.meter import StepMeter
    from mgpu.model.mlp import MLP
    from mgpu.precision.common import loss_seed, nonfinite_grads

    torch.manual_seed(0)
    model = MLP(input_shape=(1, 8, 8), num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    inputs, labels = torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,))
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward(loss_seed(loss))
    meter = StepMeter(64, 0, torch.device("cpu"))

    def per_call_us(fn) -> float:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) / calls * 1e6

    def step() -> None:
        out = F.cross_entropy(model(inputs), labels)
        out.backward()
        optimizer.step()

    return {
        "step_us": per_call_us(step),
        "loss_seed_us": per_call_us(lambda: loss_seed(loss)),
        "nonfinite_check_us": per_call_us(
            lambda: nonfinite_grads(optimizer, torch.device("cpu")).item()),
        "meter_record_us": per_call_us(lambda: meter.record(1, loss.detach(), 32)),
    }


def bench_precision(rounds: int, workdir: Path) -> dict:
    """fp32 vs bf16 vs amp (fp16 + GradScaler) under strategy=ddp: samples/s and eval accuracy.

    On CPU, bf16/fp16 autocast mostly adds casts (no tensor cores): the ratios say what the
    precision costs here; on GPUs they say what it gains.
    """
    steps, warmup = 600, 50
    common = [f"train.steps={steps}", f"train.warmup_steps={warmup}", "train.log_every=100",
              "eval.every_steps=0", "strategy=ddp", "checkpoint.every_steps=0"]
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


def bench_monitoring(rounds: int, workdir: Path) -> dict:
    """mgpu strategy=ddp with all monitoring on (phase timing, comm hook, telemetry thread,
    Prometheus exporter, MLflow system metrics, a profiler window inside warm-up) vs off.

    Target: on / off >= 0.98.
    """
    steps, warmup = 2000, 100
    common = [f"train.steps={steps}", f"train.warmup_steps={warmup}", "train.log_every=100",
              "eval.every_steps=0", "optim.schedule=constant", "strategy=ddp",
              "checkpoint.every_steps=0"]
    monitored = ["monitor.enabled=true", "monitor.profile=true",
                 "monitor.profile_start_step=10", "monitor.profile_steps=3",
                 "tracking.system_metrics=true"]
    samples = {"off": [], "on": []}
    for _ in range(rounds):
        samples["off"].append(run_mgpu(common, workdir)["train/samples_per_s"])
        on = [*common, *monitored, f"monitor.prometheus_port={free_port()}"]
        samples["on"].append(run_mgpu(on, workdir)["train/samples_per_s"])
    median = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "samples_per_s_median": median,
        "samples_per_s_rounds": samples,
        "ratio_on_to_off": median["on"] / median["off"],
        "target_ratio": 0.98,
        "setup": f"MLP 64-256-256-10 on digits, global batch 64, {steps} steps "
                 f"({warmup} warm-up), AdamW constant lr, 2 gloo processes",
    }


def log_time(run: dict, rank: int, text: str) -> float:
    """When the first line containing `text` was logged in the run's `logs/rank<rank>.log`."""
    log = (Path(run["output_dir"]) / "logs" / f"rank{rank}.log").read_text()
    line = next(line for line in log.splitlines() if text in line)
    stamp = line.split(" ", 1)[1][:23]  # "[rank0] 2026-01-01 12:00:00,123 INFO ..."
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def bench_checkpoint(rounds: int, workdir: Path) -> dict:
    """Checkpoint save time (sync vs async) and restart-to-first-step, as ratios to one step.

    save: how long a save holds up training (`checkpoint/save_s`, median over the run's saves)
    over the same run's median step (`time/step_p50_s`). restart: rank 1 is killed right after
    a checkpoint (max_restarts=1); from its kill (logged just before) to the restarted group's
    first step (restored, logged, plus one step): detection, rendezvous, start, build, restore.
    """
    steps, every = 400, 50
    common = [f"train.steps={steps}", "train.warmup_steps=20", "train.log_every=100",
              "eval.every_steps=0", "optim.schedule=constant", f"checkpoint.every_steps={every}"]
    kill = ["fault.mode=sigkill", "fault.kill_rank=1", f"fault.at_step={steps // 2 + 1}",
            "launch.max_restarts=1"]
    samples = {"save_sync_to_step": [], "save_async_to_step": [], "restart_s": [],
               "restart_to_step": [], "step_p50_s": []}
    for _ in range(rounds):
        sync = run_mgpu([*common, "checkpoint.async_save=false"], workdir)
        killed = run_mgpu([*common, "checkpoint.async_save=false", *kill], workdir)
        restart_s = (log_time(killed, 0, "resumed from") - log_time(killed, 1, "injecting")
                     + sync["time/step_p50_s"])
        background = run_mgpu([*common, "checkpoint.async_save=true"], workdir)
        step = sync["time/step_p50_s"]
        samples["step_p50_s"].append(step)
        samples["save_sync_to_step"].append(sync["checkpoint/save_s"] / step)
        samples["save_async_to_step"].append(
            background["checkpoint/save_s"] / background["time/step_p50_s"])
        samples["restart_s"].append(restart_s)
        samples["restart_to_step"].append(restart_s / step)
    return {
        **{f"{name}_median": statistics.median(values) for name, values in samples.items()},
        "rounds": samples,
        "setup": f"MLP 64-256-256-10 on digits, 2 gloo processes, {steps} steps, a checkpoint "
                 f"every {every}; restart: rank 1 SIGKILLed at step {steps // 2 + 1}, "
                 "the first step after a checkpoint",
    }


def log_lines(output_dir: Path, rank: int, pattern: str) -> list[tuple[float, re.Match]]:
    """(time logged, match) of each line of `logs/rank<rank>.log` matching `pattern`, over
    every attempt of the run (each restarted rank appends to its log)."""
    found = []
    for line in (output_dir / "logs" / f"rank{rank}.log").read_text().splitlines():
        match = re.search(pattern, line)
        if match and line.startswith(f"[rank{rank}] "):  # not a message's later lines
            stamp = line.split(" ", 1)[1][:23]  # "[rank0] 2026-01-01 12:00:00,123 INFO ..."
            found.append((datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), match))
    return found


def training_phase_s(output_dir: Path) -> float:
    """From rank 0's first "training N steps" line (after the parent prepared, the group
    started and the state was built) to its last line (the final evaluation): the time the
    run's steps took, restarts included, without the interpreter's and MLflow's start."""
    lines = log_lines(output_dir, 0, r"")
    started = next(t for t, m in log_lines(output_dir, 0, r"training \d+ steps"))
    return lines[-1][0] - started


def recoveries(output_dir: Path, world_size: int) -> list[dict]:
    """Per injected fault, in the order they fired: its kind, rank and step; how long from
    its injection (logged by the failing rank just before it fails) until the restarted
    group completed its first step (rank 0's "the first after restart k" line); and the
    steps done again: those completed before the fault (step - 1; the checkpoint's step for
    a kill while writing it) less the step the restart resumed from."""
    injected = sorted(
        (stamp, match) for rank in range(world_size)
        for stamp, match in log_lines(output_dir, rank,
                                      r"injecting fault\.mode=(\w+) on rank (\d+) at step (\d+)"))
    firsts = {int(m[2]): (stamp, int(m[1])) for stamp, m in log_lines(
        output_dir, 0, r"step (\d+) done, the first after restart (\d+)")}
    figures = []
    for k, (failed_at, match) in enumerate(injected):
        mode, rank, step = match[1], int(match[2]), int(match[3])
        recovered_at, first_step = firsts[k + 1]
        completed = step if mode == "checkpoint_sigkill" else step - 1
        figures.append({"kind": mode, "rank": rank, "step": step,
                        "recovery_s": round(recovered_at - failed_at, 2),
                        "steps_recomputed": completed - (first_step - 1)})
    return figures


def same_weights(a: Path, b: Path) -> bool:
    """Whether two runs' final `model.pt` hold bitwise the same tensors."""
    first = torch.load(a / "model.pt", weights_only=True)
    second = torch.load(b / "model.pt", weights_only=True)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


#: The chaos runs (train.steps, overrides): the default job with five faults by checkpoint
#: interval and async save, and a ten times longer run, over which restarts cost less.
CHAOS_VARIANTS = {
    "every25": (500, ["checkpoint.every_steps=25"]),
    "every50": (500, ["checkpoint.every_steps=50"]),
    "every100": (500, ["checkpoint.every_steps=100"]),
    "every50_async": (500, ["checkpoint.every_steps=50", "checkpoint.async_save=true"]),
    "steps5000_every50": (5000, ["checkpoint.every_steps=50"]),
}


def bench_chaos(_rounds: int, workdir: Path) -> dict:
    """The default job (500 steps) fault-free, then with 5 faults (`fault.schedule`: SIGKILL,
    exception, hang, a kill while writing a checkpoint, SIGKILL, at seeded random steps and
    ranks) at several checkpoint intervals, sync and async, and a 5000-step run alike:
    goodput (useful samples/s over the fault-free run's of the same length, the same samples:
    its time over theirs), recovery time per fault (p50, p95: injection to the restarted
    group's first completed step), steps recomputed per fault, and whether the final weights
    are bitwise the fault-free run's.

    One round: each chaos run holds five recoveries. `launch.timeout_s=5` in every run, so a
    hang is found after 5 s (a fault-free run is unchanged by it). Goodput is given over the
    training phase (rank 0's first "training" log line to its last, restarts included) and
    over the whole invocation. The fault-free runs save as the default job does (every 100
    steps, sync), so a shorter interval's cost counts against goodput.
    """
    count = 5
    common = ["launch.timeout_s=5"]
    faults = [f"fault.schedule.count={count}", "fault.schedule.seed=1",
              f"launch.max_restarts={count}"]
    quiet = wait_for_quiet()
    clean = {}
    for steps in sorted({steps for steps, _ in CHAOS_VARIANTS.values()}):
        started = time.perf_counter()
        summary = run_mgpu([*common, f"train.steps={steps}"], workdir)
        clean[steps] = {"run": summary, "wall_s": time.perf_counter() - started,
                        "training_phase_s": training_phase_s(summary["output_dir"])}
    variants = {}
    for name, (steps, overrides) in CHAOS_VARIANTS.items():
        started = time.perf_counter()
        chaos = run_mgpu([*common, f"train.steps={steps}", *faults, *overrides], workdir)
        wall = time.perf_counter() - started
        per_fault = recoveries(chaos["output_dir"], world_size=2)
        times = sorted(fault["recovery_s"] for fault in per_fault)
        phase = training_phase_s(chaos["output_dir"])
        baseline = clean[steps]
        variants[name] = {
            "train.steps": steps,
            "goodput": baseline["training_phase_s"] / phase,
            "goodput_whole_invocation": baseline["wall_s"] / wall,
            "recovery_s_p50": statistics.median(times),
            "recovery_s_p95": statistics.quantiles(times, n=20, method="inclusive")[-1],
            "steps_recomputed_mean": statistics.mean(f["steps_recomputed"] for f in per_fault),
            "bitwise_equal_to_fault_free": same_weights(chaos["output_dir"],
                                                        baseline["run"]["output_dir"]),
            "faults_fired": len(per_fault),
            "per_fault": per_fault,
            "training_phase_s": round(phase, 2),
            "wall_s": round(wall, 1),
        }
    return {
        "variants": variants,
        "fault_free": {steps: {"training_phase_s": round(c["training_phase_s"], 2),
                               "wall_s": round(c["wall_s"], 1),
                               "train/samples_per_s": c["run"]["train/samples_per_s"]}
                       for steps, c in clean.items()},
        "targets": {"goodput_every50": 0.8, "recovery_s_p95": 15.0, "bitwise_equal": True},
        "machine_before": quiet,
        "load_average_after": os.getloadavg(),
        "setup": f"the default job: MLP 64-256-256-10 on digits, global batch 64, 500 steps "
                 f"(and 5000), eval every 100, AdamW cosine, 2 gloo processes, "
                 f"launch.timeout_s=5; {count} faults (fault.schedule.seed=1: both ranks "
                 f"fail; kinds sigkill, exception, hang, checkpoint_sigkill taken in turn), "
                 f"launch.max_restarts="
                 f"{count}; the fault-free runs save every 100 steps (the default), sync",
    }


# A compute-bound model without batch statistics: model=cnn is refused with an uneven split
# (BatchNorm normalises over each rank's local batch). A small gpt reading each pixel as a token
# (model.patch=1: 64 tokens a sample) spends most of a step in its own forward and backward, as
# a CNN does, at either global batch; with 4x4 patches (4 tokens) the fixed per-step costs are
# most of a step at global batch 64 and no split can win back half of what the straggler loses.
SLOWDOWN = ["straggler.slowdown=[1.0,2.0]", "model=gpt", "model.dim=32", "model.layers=2",
            "model.patch=1"]
SPLITTERS = {"none": ["balance=none"],
             "throughput": ["balance=throughput", "balance.warmup_steps=10"],
             "thermal": ["balance=thermal", "balance.warmup_steps=10"]}
STRAGGLER_SCENARIOS = {
    # Rank 1 slowed 2x, at a small and a large global batch: at 64 a step's fixed costs are a
    # larger share of each rank's work, which a split in proportion to samples/s gets wrong.
    "slowdown64": ([*SLOWDOWN, "data.batch_size=64"], SPLITTERS),
    "slowdown256": ([*SLOWDOWN, "data.batch_size=256"], SPLITTERS),
    # Every rank delayed at random each step (exponential, mean 10 ms); MLP, global batch 64.
    "jitter": (["straggler.jitter_s=0.01"],
               {"none": ["balance=none"], "ssp": ["balance=ssp", "balance.staleness=2"]}),
}
SLOWDOWN_TARGETS = {"slowdown64": 1.40, "slowdown256": 1.45}


def measured_slowdown(summary: dict) -> float:
    """How much slower rank 1's own work is per sample than rank 0's, as the run measured it."""
    return summary["balance/samples_per_s_rank0"] / summary["balance/samples_per_s_rank1"]


def ideal_ratio(summary: dict) -> float:
    """The best a split can do against this `none` run: its step, over its step with the
    ranks' own work evened out and the rest (all-reduce, optimizer step) left as it was.

    Each rank's own work per step is its share over its own samples/s; evened out, the ranks
    finish together after global batch / (sum of their samples/s) — also where each rank has a
    fixed cost, if the straggler is slower at it by the same factor (as simulated). Without the
    rest of the step this is (1 + f) / 2 for a straggler f times slower."""
    rates = [summary[f"balance/samples_per_s_rank{r}"] for r in (0, 1)]
    shares = [summary[f"balance/batch_rank{r}"] for r in (0, 1)]
    step = sum(shares) / summary["train/samples_per_s"]
    rest = step - max(share / rate for share, rate in zip(shares, rates, strict=True))
    return step / (rest + sum(shares) / sum(rates))


def bench_straggler(rounds: int, workdir: Path) -> dict:
    """Simulated stragglers, side by side: how much of the lost throughput balance wins back.

    - slowdown: rank 1's compute takes f = 2x as long; balance=none vs throughput and thermal
      (without NVML thermal is throughput) at global batch 64 (target >= 1.40) and 256
      (target >= 1.45). Beside each: the ideal from the `none` runs (`ideal_ratio`: its step
      over its step with the ranks' own work evened out), and (1 + f) / 2, the ideal were the
      ranks' own work the whole step, with f as `none` measured it (rank 1's per-sample time
      over rank 0's).
    - jitter: every rank sleeps a random time per step; balance=none vs ssp with staleness 2
      (target >= 1.2).
    Round i runs every option with seed=i (model init, data order, jitter), so the options of a
    round differ only in the balance. Mean final eval accuracy over rounds is reported per
    option: balancing must not cost accuracy (within 1 point of `none`). The load average before
    and after says how busy the machine was besides: the simulated straggler sleeps, leaving
    its core to whatever else runs, so a busy machine takes away what balancing would win.
    """
    steps = ["train.steps=300", "train.warmup_steps=60", "train.log_every=100",
             "eval.every_steps=0", "optim.schedule=constant", "checkpoint.every_steps=0"]
    names = [f"{s}/{o}" for s, (_, options) in STRAGGLER_SCENARIOS.items() for o in options]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    load_before = os.getloadavg()
    for seed in range(rounds):
        for scenario, (common, options) in STRAGGLER_SCENARIOS.items():
            for option, overrides in options.items():
                summary = run_mgpu([*steps, *common, *overrides, f"seed={seed}"], workdir)
                runs[f"{scenario}/{option}"].append(summary)
    rates = {name: [s["train/samples_per_s"] for s in runs[name]] for name in names}
    accuracy = {name: [s["eval/accuracy"] for s in runs[name]] for name in names}
    median = {name: statistics.median(values) for name, values in rates.items()}
    mean_accuracy = {name: statistics.mean(values) for name, values in accuracy.items()}
    report = {
        "samples_per_s_median": median,
        "samples_per_s_rounds": rates,
        "ratio_ssp_to_none": median["jitter/ssp"] / median["jitter/none"],
        "target_ratio_ssp": 1.2,
        "eval_accuracy_rounds": accuracy,
        "eval_accuracy_mean": mean_accuracy,
        "accuracy_gap_points": {
            name: 100 * (mean_accuracy[name] - mean_accuracy[f"{name.split('/')[0]}/none"])
            for name in names if not name.endswith("/none")},
    }
    for scenario, target in SLOWDOWN_TARGETS.items():
        slowdown = statistics.median(measured_slowdown(s) for s in runs[f"{scenario}/none"])
        report[scenario] = {
            **{f"ratio_{option}_to_none": median[f"{scenario}/{option}"]
               / median[f"{scenario}/none"] for option in ("throughput", "thermal")},
            "target_ratio": target,
            "ideal_ratio": statistics.median(ideal_ratio(s) for s in runs[f"{scenario}/none"]),
            "measured_slowdown_none": slowdown,
            "ideal_ratio_own_work_only": (1 + slowdown) / 2,
            **{f"final_split_{option}_rounds": [
                [int(s["balance/batch_rank0"]), int(s["balance/batch_rank1"])]
                for s in runs[f"{scenario}/{option}"]] for option in ("throughput", "thermal")},
        }
    return {
        **report,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "setup": "2 gloo processes, 300 steps (60 warm-up), AdamW constant lr, seed = round; "
                 "slowdown: gpt (dim 32, 2 blocks, 64 tokens a sample) on digits, global batch "
                 "64 and 256, rank 1 slowed 2x; jitter: MLP 64-256-256-10, global batch 64, "
                 "exponential jitter mean 10 ms per step and rank",
    }


COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "onebit")


def bench_compression(rounds: int, workdir: Path) -> dict:
    """Each compression on strategy=ddp, 2 processes, the default run (500 steps): bytes this
    rank puts on the wire per step and the ratio to plain fp32 all-reduce (both from the last
    log window, after every warm-up), samples/s and final accuracy, side by side."""
    common = ["strategy=ddp", "eval.every_steps=0", "checkpoint.every_steps=0"]
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
                       "500 steps, AdamW cosine, 2 gloo processes; bytes: what one rank puts "
                       "on the wire per optimizer step (ring all-reduce / all_gather)")
    report["onebit_by_world_size"] = onebit_by_world_size(workdir)
    return report


def onebit_by_world_size(workdir: Path) -> dict:
    """onebit against the fp32 all-reduce at 2, 4 and 8 processes: bytes one rank sends per
    step after the warm-up (short runs), and at 4 processes the default run's accuracy beside
    compression=none's."""
    short = ["strategy=ddp", "eval.every_steps=0", "checkpoint.every_steps=0",
             "train.steps=40", "train.log_every=20", "compression.warmup_steps=10"]
    figures = {}
    for world in (2, 4, 8):
        ranks = f"launch.nproc_per_node={world}"
        plain = run_mgpu([*short[:-1], ranks], workdir)["comm/bytes_per_step"]
        onebit = run_mgpu([*short, ranks, "compression=onebit"], workdir)
        figures[f"W{world}"] = {
            "fp32_allreduce_bytes_per_step": plain,
            "onebit_bytes_per_step": onebit["comm/bytes_per_step"],
            "wire_ratio": plain / onebit["comm/bytes_per_step"],
        }
    default = ["strategy=ddp", "launch.nproc_per_node=4", "eval.every_steps=0",
               "checkpoint.every_steps=0"]
    figures["W4_eval_accuracy"] = {
        name: run_mgpu([*default, f"compression={name}"], workdir)["eval/accuracy"]
        for name in ("none", "onebit")}
    return figures


STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp"],
    "zero1": ["strategy=zero1"],
    "fsdp": ["strategy=fsdp"],
    "fsdp_bf16_reduce": ["strategy=fsdp", "compression=bf16"],
    "tp": ["strategy=tp"],
    "tp_sequence_parallel": ["strategy=tp", "strategy.sequence_parallel=true"],
    "pp_gpipe": ["strategy=pp", "strategy.schedule=gpipe"],
    "pp_1f1b": ["strategy=pp", "strategy.schedule=1f1b"],
    "pp_1f1b_amp": ["strategy=pp", "strategy.schedule=1f1b", "precision=amp"],
    "pp_interleaved_1f1b": ["strategy=pp", "strategy.schedule=interleaved_1f1b"],
    "hybrid_dp2_tp2": ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2"],
    "hybrid_dp2_pp2": ["strategy=hybrid", "strategy.dp=2", "strategy.pp=2"],
}


def bench_strategies(rounds: int, workdir: Path) -> dict:
    """Every strategy on model=gpt as a language model on data=text: throughput, bytes per
    rank, pipeline bubble (measured and the schedule's (p-1)/(v*m+p-1)). 2 processes, 4 for
    hybrid; SGD so state is one buffer."""
    steps, warmup = 60, 10
    common = ["model=gpt", "data=text", "optim=sgd", f"train.steps={steps}",
              f"train.warmup_steps={warmup}", "train.log_every=10", "eval.every_steps=0",
              "optim.schedule=constant"]
    keep = ("train/samples_per_s", "comm/bytes_per_step", "memory/param_bytes_per_rank",
            "memory/optimizer_bytes_per_rank", "memory/peak_bytes", "pp/bubble_fraction",
            "pp/bubble_transfer_fraction", "pp/bubble_schedule_fraction",
            "pp/bubble_overhead_fraction",
            "pp/bubble_fraction_theory", "eval/loss", "eval/accuracy")
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
        "setup": f"model=gpt (dim 64, 4 heads, 4 blocks) on data=text: 16 sequences of 64 "
                 f"bytes per step, {steps} steps ({warmup} warm-up), SGD, gloo",
    }


#: The pipeline section's job: the language model on text at 4 processes, 8 blocks so that the
#: two-stages-per-rank schedules have a block per stage at pp=4, 8 micro-batches (2 per stage
#: of the V schedules; 1 sequence each under pp=2 x dp=2).
PIPELINE_JOB = ["model=gpt", "data=text", "model.layers=8", "optim=sgd",
                "optim.schedule=constant", "eval.every_steps=0", "checkpoint.every_steps=0"]
#: name: (overrides, pp, dp, stages sharded by FSDP2 as hybrid shards them).
PIPELINE_LAYOUTS = {"pp4": (["strategy=pp"], 4, 1, False),
                    "pp2xdp2": (["strategy=hybrid", "strategy.dp=2", "strategy.pp=2"], 2, 2, True)}


def bench_pipeline(rounds: int, workdir: Path) -> dict:
    """Every `strategy.schedule` at pp=4 and at pp=2 x dp=2 (where hybrid runs it; a refusal is
    recorded with its line), beside ddp on the same job: samples/s, the measured bubble over the
    schedule's theory, the peak memory of each pipeline rank, and eval/loss after the same
    samples; plus 2bw's throughput and eval loss against 1f1b's, at pp=4 and with one process
    per core (pp=2, 2 processes). One round (`rounds` is not used): 15 runs keep the section to
    a few minutes on a 2-core machine; a refused schedule is not launched, its line is the
    parent's own check's."""
    steps, warmup = 24, 8
    job = [*PIPELINE_JOB, f"train.steps={steps}", f"train.warmup_steps={warmup}",
           f"train.log_every={steps}"]
    common = [*job, "launch.nproc_per_node=4"]
    from mgpu.errors import ConfigError
    from mgpu.pipeline import SCHEDULES, check_pipeline

    runs: dict[str, dict] = {}
    loadavg = [os.getloadavg()[0]]
    ddp = run_mgpu([*common, "strategy=ddp"], workdir)
    runs["ddp"] = {"train/samples_per_s": ddp["train/samples_per_s"],
                   "eval/loss": ddp["eval/loss"], "memory/peak_bytes": ddp["memory/peak_bytes"]}
    for layout, (overrides, pp, dp, sharded) in PIPELINE_LAYOUTS.items():
        for schedule in SCHEDULES:
            name = f"{layout}/{schedule}"
            try:
                check_pipeline(16, schedule, 8, pp, dp, sharded)
            except ConfigError as refused:
                runs[name] = {"refused": str(refused)}
                continue
            summary = run_mgpu([*common, *overrides, f"strategy.schedule={schedule}",
                                "strategy.microbatches=8"], workdir)
            measured, theory = summary["pp/bubble_fraction"], summary["pp/bubble_fraction_theory"]
            runs[name] = {
                "train/samples_per_s": summary["train/samples_per_s"],
                "vs_ddp": summary["train/samples_per_s"] / ddp["train/samples_per_s"],
                "bubble": measured, "bubble_theory": theory,
                "bubble_transfer": summary["pp/bubble_transfer_fraction"],
                "bubble_schedule": summary["pp/bubble_schedule_fraction"],
                "bubble_overhead": summary["pp/bubble_overhead_fraction"],
                "measured_over_theory": measured / theory if theory else None,
                "peak_bytes_per_pipeline_rank": [
                    summary[key] for key in sorted(k for k in summary
                                                   if k.startswith("pp/peak_bytes_rank"))],
                "eval/loss": summary["eval/loss"],
            }
        loadavg.append(os.getloadavg()[0])
    # Four processes share two cores, so one rank's bubble is another's compute time; with
    # one process per core (pp=2) a bubble is a core idle, which is what 2bw removes.
    for schedule in ("1f1b", "2bw"):
        summary = run_mgpu([*job, "launch.nproc_per_node=2", "strategy=pp",
                            f"strategy.schedule={schedule}", "strategy.microbatches=8"], workdir)
        runs[f"pp2_2procs/{schedule}"] = {
            "train/samples_per_s": summary["train/samples_per_s"],
            "bubble": summary["pp/bubble_fraction"],
            "bubble_theory": summary["pp/bubble_fraction_theory"],
            "eval/loss": summary["eval/loss"]}
    loadavg.append(os.getloadavg()[0])

    def ratio(layout: str) -> dict:
        stale, flushed = runs[f"{layout}/2bw"], runs[f"{layout}/1f1b"]
        return {"samples_per_s": stale["train/samples_per_s"] / flushed["train/samples_per_s"],
                "eval_loss": stale["eval/loss"] / flushed["eval/loss"] - 1}

    return {
        "runs": runs,
        "2bw_vs_1f1b": {layout: ratio(layout) for layout in ("pp4", "pp2_2procs")},
        "load_average_1min": loadavg,
        "setup": f"model=gpt (dim 64, 4 heads, 8 blocks) on data=text, 16 sequences of 64 bytes "
                 f"per step, 8 micro-batches, {steps} steps ({warmup} warm-up; eval/loss after "
                 f"the same {steps * 16} samples), SGD constant lr, 4 gloo processes; theory 0 "
                 f"for 2bw (no flush: its steady state has no bubble)",
    }


#: The wide pipeline section's job: a gpt wide enough that a stage's compute of a micro-batch
#: (tens of ms on CPU) dwarfs moving its activation (a fraction of a ms), on 2 stages with one
#: process per core, so a bubble is a core left idle.
WIDE_PIPELINE_JOB = ["model=gpt", "data=text", "model.dim=256", "model.layers=8",
                     "data.batch_size=32", "checkpoint.every_steps=0", "launch.nproc_per_node=2",
                     "strategy=pp"]


def bubble_parts(summary: dict) -> dict:
    """A pipeline run's samples/s and its bubble's parts against the schedule's theory, with
    the stages' compute time over their transfer time."""
    idle, theory = summary["pp/bubble_fraction"], summary["pp/bubble_fraction_theory"]
    schedule = summary["pp/bubble_schedule_fraction"]
    transfer = summary["pp/bubble_transfer_fraction"]
    return {
        "train/samples_per_s": summary["train/samples_per_s"],
        "bubble": idle, "bubble_theory": theory,
        "bubble_schedule": schedule, "bubble_transfer": transfer,
        "bubble_overhead": summary["pp/bubble_overhead_fraction"],
        "measured_over_theory": idle / theory if theory else None,
        "schedule_over_theory": schedule / theory if theory else None,
        "compute_over_transfer": (1 - idle) / transfer if transfer else None,
    }


def bench_pipeline_wide(rounds: int, workdir: Path) -> dict:
    """Where stage compute dominates transfers (`WIDE_PIPELINE_JOB`): gpipe, 1f1b and
    interleaved_1f1b at m = 4 and 8 (m >= 2p), each bubble's schedule part against the
    schedule's theory; then 2bw against 1f1b at m = 4, samples/s and eval/loss after the same
    samples (AdamW, cosine with a 10 % warm-up) at two learning rates: a one-step-stale update
    costs more the larger the step. One round (`rounds` is not used)."""
    runs: dict[str, dict] = {}
    loadavg = [os.getloadavg()[0]]
    short = [*WIDE_PIPELINE_JOB, "optim=sgd", "optim.schedule=constant", "train.steps=20",
             "train.warmup_steps=5", "train.log_every=20", "eval.every_steps=0"]
    for m in (4, 8):
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
            summary = run_mgpu([*short, f"strategy.schedule={schedule}",
                                f"strategy.microbatches={m}"], workdir)
            runs[f"m{m}/{schedule}"] = bubble_parts(summary)
    loadavg.append(os.getloadavg()[0])
    steps = 150
    stale: dict[str, dict] = {}
    for lr in (2e-3, 5e-4):
        for schedule in ("1f1b", "2bw"):
            summary = run_mgpu([*WIDE_PIPELINE_JOB, "optim=adamw", f"optim.lr={lr}",
                                "optim.schedule=cosine", f"optim.warmup_steps={steps // 10}",
                                f"train.steps={steps}", "train.warmup_steps=5",
                                f"train.log_every={steps // 3}", "eval.every_steps=0",
                                f"strategy.schedule={schedule}", "strategy.microbatches=4"],
                               workdir)
            runs[f"adamw_lr{lr}/{schedule}"] = {**bubble_parts(summary),
                                               "eval/loss": summary["eval/loss"]}
        flushed, delayed = runs[f"adamw_lr{lr}/1f1b"], runs[f"adamw_lr{lr}/2bw"]
        stale[f"lr{lr}"] = {
            "samples_per_s": delayed["train/samples_per_s"] / flushed["train/samples_per_s"],
            "eval_loss": delayed["eval/loss"] / flushed["eval/loss"] - 1}
        loadavg.append(os.getloadavg()[0])
    return {
        "runs": runs,
        "2bw_vs_1f1b": stale,
        "load_average_1min": loadavg,
        "setup": "model=gpt (dim 256, 4 heads, 8 blocks) on data=text, 32 sequences of 64 bytes "
                 "per step, pp=2 on 2 gloo processes (one per core); schedules: 20 steps (5 "
                 f"warm-up), SGD; 2bw against 1f1b: {steps} steps, AdamW, eval/loss after the "
                 f"same {steps * 32} samples",
    }


#: The layouts of the scaling section at each world size; hybrid adds data parallelism to tp.
SCALING = {
    "ddp": {n: ["strategy=ddp"] for n in (1, 2, 4)},
    "fsdp": {n: ["strategy=fsdp"] for n in (1, 2, 4)},
    "hybrid": {1: ["strategy=hybrid", "strategy.dp=1", "strategy.tp=1"],
               2: ["strategy=hybrid", "strategy.dp=1", "strategy.tp=2"],
               4: ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2"]},
}


def bench_scaling(rounds: int, workdir: Path) -> dict:
    """ddp, fsdp and hybrid (dp x tp) on the language model (model=gpt data=text) at 1, 2 and 4
    processes: samples/s (global batch fixed) and efficiency against the same strategy's
    1-process run, samples/s(n) / samples/s(1). Compute is not added with processes here (the
    2-core machine shares its cores): what the figure shows is each strategy's cost of going
    distributed, so a regression in one strategy's overhead shows as its efficiency falling
    against the others'.
    """
    common = ["model=gpt", "data=text", "train.steps=60", "train.warmup_steps=10",
              "train.log_every=30", "eval.every_steps=0", "checkpoint.every_steps=0",
              "optim.schedule=constant"]
    samples = {f"{s}/{n}": [] for s, sizes in SCALING.items() for n in sizes}
    quiet = []
    for _ in range(rounds):
        quiet.append(wait_for_quiet())
        for strategy, sizes in SCALING.items():
            for n, overrides in sizes.items():
                summary = run_mgpu([*common, *overrides, f"launch.nproc_per_node={n}"], workdir)
                samples[f"{strategy}/{n}"].append(summary["train/samples_per_s"])
    median = {name: statistics.median(values) for name, values in samples.items()}
    efficiency = {
        f"{s}/{n}": median[f"{s}/{n}"] / median[f"{s}/1"] for s, sizes in SCALING.items()
        for n in sizes
    }
    return {
        "samples_per_s_median": median,
        "efficiency_vs_1_process": efficiency,
        "samples_per_s_rounds": samples,
        "machine_before_each_round": quiet,
        "setup": "model=gpt on data=text (its default batch), 60 steps (10 warm-up), AdamW "
                 "constant lr, gloo processes on one machine",
    }


#: The planner's bench job: model=gpt as a language model at 4 processes (as `strategies`).
PLAN_JOB = ["model=gpt", "data=text", "optim=sgd", "optim.schedule=constant",
            "launch.nproc_per_node=4"]
PLAN_TRIALS = 3


def plan_rows(overrides: list[str]) -> list:
    """The planner's ranked rows for the job, as strategy=auto would plan it here."""
    from hydra import compose, initialize_config_dir

    from mgpu.config import prepare
    from mgpu.options import CONF
    from mgpu.plan import plan_job
    from mgpu.plan.machine import measure

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config",
                      overrides=[*overrides, "output_dir=.", "tracking.enabled=false"])
    job, options = prepare(cfg, torch.cuda.device_count(), None)
    world = job.launch.world_size
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    machine = measure(options, job.data["batch_size"] // world, world, device)
    return plan_job(job, options, machine, None)


def plan_grid(rows: list) -> list:
    """The layouts timed: the top `PLAN_TRIALS` predicted (what trials would time), then the
    fastest predicted of each strategy, degrees and schedule, without recompute or offload."""
    grid, seen = list(rows[:PLAN_TRIALS]), set()
    for row in rows:
        plan = row.candidate.plan
        family = (row.candidate.option, plan.dp, plan.tp, plan.pp,
                  plan.pipeline.schedule if plan.pipeline else None)
        offload = getattr(plan.data_parallel, "cpu_offload", False)
        if family in seen or plan.activation_checkpointing != "none" or offload:
            continue
        seen.add(family)
        if row not in grid:
            grid.append(row)
    return grid


def measure_plan_links(workdir: Path) -> str:
    """The links the planner prices collectives with, measured here by task=commbench at the
    plan job's world size (gloo's latency on shared cores is far above the stated default),
    into a cache of the bench's own, which this process and its runs read; returns its path."""
    cache = workdir / "plan-cache"
    os.environ["MGPU_CACHE_DIR"] = str(cache)
    subprocess.run(
        [sys.executable, "-m", "mgpu", "task=commbench", "task.max_bytes=4194304",
         *[o for o in PLAN_JOB if o.startswith("launch.")], "tracking.enabled=false",
         f"hydra.run.dir={workdir / 'plan-commbench'}"],
        cwd=workdir, check=True, capture_output=True, text=True,
    )
    return str(next(cache.glob("commbench-*.json")))


def bench_plan(rounds: int, workdir: Path) -> dict:
    """The planner against measurement on model=gpt at 4 processes: predicted vs measured step
    time (p50) per layout of a grid, and where strategy=auto's pick lands against the fastest
    measured layout of the grid, without trials (the first predicted) and with trials=3 (the
    fastest measured of the top 3 predicted)."""
    steps, warmup = 30, 10
    common = [*PLAN_JOB, f"train.steps={steps}", f"train.warmup_steps={warmup}",
              "train.log_every=10", "eval.every_steps=0", "checkpoint.every_steps=0"]
    links = measure_plan_links(workdir)
    rows = plan_rows(common)
    grid = plan_grid(rows)
    measured: dict[str, list[float]] = {row.candidate.name: [] for row in grid}
    for _ in range(rounds):
        for row in grid:
            summary = run_mgpu([*common, *row.candidate.overrides()], workdir)
            measured[row.candidate.name].append(summary["time/step_p50_s"])
    per_layout = {}
    for row in grid:
        seconds = statistics.median(measured[row.candidate.name])
        per_layout[row.candidate.name] = {
            "predicted_step_s": row.time.seconds, "measured_step_s": seconds,
            "error": row.time.seconds / seconds - 1,
            "predicted_rank": rows.index(row) + 1,
            "predicted_device_bytes_per_rank": row.memory.device,
        }
    best = min(v["measured_step_s"] for v in per_layout.values())
    top = [row.candidate.name for row in rows[:PLAN_TRIALS]]
    trial_pick = min(top, key=lambda name: per_layout[name]["measured_step_s"])
    return {
        "per_layout": per_layout,
        "auto_pick_no_trials": top[0],
        "auto_no_trials_vs_best": per_layout[top[0]]["measured_step_s"] / best,
        "auto_pick_trials3": trial_pick,
        "auto_trials3_vs_best": per_layout[trial_pick]["measured_step_s"] / best,
        "best_measured": min(per_layout, key=lambda n: per_layout[n]["measured_step_s"]),
        "median_abs_error": statistics.median(abs(v["error"]) for v in per_layout.values()),
        "setup": f"model=gpt (dim 64, 4 heads, 4 blocks) on data=text, 4 processes, "
                 f"{len(rows)} layouts planned, {len(grid)} timed, {steps} steps ({warmup} "
                 f"warm-up), SGD, gloo; best = fastest measured of the timed grid; links "
                 f"measured by task=commbench at 4 processes ({links})",
    }


#: The test tier's planner jobs (tests/test_plan.py): (processes, model overrides, optimizer).
PLAN_MEMORY_JOBS = {
    "2-mlp-adamw": (2, ["model=mlp"], "adamw"),
    "4-mlp-adamw": (4, ["model=mlp", "model.hidden=[64,64,64,64]"], "adamw"),
    "2-cnn-sgd": (2, ["model=cnn"], "sgd"),
    "2-gpt-adamw": (2, ["model=gpt", "model.dim=32", "model.mlp_ratio=2"], "adamw"),
    "4-gpt-sgd": (4, ["model=gpt", "model.dim=32", "model.mlp_ratio=2"], "sgd"),
}


def bench_plan_memory(rounds: int, workdir: Path) -> dict:
    """Every candidate layout of the test tier's planner jobs: predicted device bytes per rank
    over the most bytes the rank allocated at once in a real step (torch.profiler's memory
    events, the test's own measurement, the least of `rounds` fresh builds). One launch per
    job measures all of its layouts in turn."""
    sys.path.insert(0, str(ROOT))
    from mgpu.plan import plan_job
    from tests.conftest import launch_ranks
    from tests.test_plan import MACHINE, ONE_STEP, job_and_options, measure_peaks

    jobs, ratios = {}, []
    for name, (ranks, model, optim) in PLAN_MEMORY_JOBS.items():
        (workdir / name).mkdir(parents=True)
        job, options = job_and_options(
            [*model, f"optim={optim}", f"launch.nproc_per_node={ranks}", *ONE_STEP],
            workdir / name)
        rows = plan_job(job, options, MACHINE, None)
        measured = launch_ranks(measure_peaks, ranks, f"plan-memory-{name}", job,
                                [row.candidate.node for row in rows], rounds)
        layouts = {}
        for i, row in enumerate(rows):
            per_rank = [row.ranks[r].device / measured[r][i] for r in range(ranks)]
            layouts[row.candidate.name] = [round(x, 3) for x in per_rank]
            ratios += per_rank
        outside = {n: r for n, r in layouts.items() if min(r) < 0.85 or max(r) > 1.15}
        jobs[name] = {"layouts": len(layouts), "outside_15_percent": outside,
                      "predicted_over_measured": layouts}
    return {
        "jobs": jobs,
        "rank_ratios": len(ratios),
        "within_15_percent": sum(0.85 <= x <= 1.15 for x in ratios),
        "min": round(min(ratios), 3), "max": round(max(ratios), 3),
        "median": round(statistics.median(ratios), 3),
        "setup": "predicted device bytes per rank (RankMemory.device) over the step peak "
                 "tests/test_plan.py measures (second training step, less the data set), "
                 f"least of {rounds} builds per layout; CPU, gloo",
    }


SECTIONS = {
    "overhead": bench_overhead,
    "precision": bench_precision,
    "commbench": bench_commbench,
    "monitoring": bench_monitoring,
    "checkpoint": bench_checkpoint,
    "chaos": bench_chaos,
    "straggler": bench_straggler,
    "compression": bench_compression,
    "strategies": bench_strategies,
    "pipeline": bench_pipeline,
    "pipeline_wide": bench_pipeline_wide,
    "scaling": bench_scaling,
    "plan": bench_plan,
    "plan_memory": bench_plan_memory,
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
