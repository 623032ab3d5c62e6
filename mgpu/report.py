"""`python -m mgpu.report`: a sweep from MLflow as a table and plots, logged to its parent run.

    python -m mgpu.report --experiment mgpu          # the experiment's latest sweep
    python -m mgpu.report --run <parent run id>      # a given sweep

Writes `report.md`, `report.csv` and PNG plots (samples/s against accuracy, one panel per
strategy / compression / precision choice; a scaling curve where the world size varies; the
planner's predicted against the measured step time and state bytes per rank) into
`--out` (default `reports/<parent run id>`), and logs them to the sweep's parent run under
`report/`, so the comparison sits next to the runs in the MLflow UI.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from matplotlib.figure import Figure  # files only: no pyplot, no display backend
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from mgpu.job import GROUPS, resolve_tracking_uri
from mgpu.plan.calibration import ERROR_STATE, ERROR_STEP, PREDICTED_STEP
from mgpu.tracking import param_records, record, tags_within_limits, write_record

SWEEP_TAG = "mgpu.sweep_dir"
PARENT_TAG = "mlflow.parentRunId"
# Always shown where present: the groups the issue compares by, and the number of processes.
CONFIG_COLUMNS = ("strategy", "compression", "precision", "launch.world_size")
METRIC_COLUMNS = (
    "train/samples_per_s", "eval/accuracy", "eval/loss", "train/loss", "time/step_p50_s",
    "comm/allreduce_s", "comm/bytes_per_step", "train/mfu", "host/other_cpu_fraction",
    ERROR_STEP, ERROR_STATE,
)
#: A run whose timed steps shared the machine with more than this much other CPU load
#: (`host/other_cpu_fraction`) is marked contended: its speed is not comparable with a quiet run's.
CONTENDED_ABOVE = 0.10


def timing(run: Run) -> str:
    """'contended' where other processes used the machine while the run was timed, else
    'quiet' ('' where the run did not measure it)."""
    other = run.data.metrics.get("host/other_cpu_fraction")
    if other is None:
        return ""
    return "contended" if other > CONTENDED_ABOVE else "quiet"
PLOT_GROUPS = ("strategy", "compression", "precision")


def find_sweep(client: MlflowClient, experiment: str | None, run_id: str | None) -> Run:
    """The parent run given by id, else the latest sweep parent run of the experiment."""
    if run_id:
        return client.get_run(run_id)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise SystemExit(f"mgpu.report: no experiment named {experiment!r}")
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"])
    sweeps = [r for r in runs if SWEEP_TAG in r.data.tags]
    if not sweeps:
        raise SystemExit(f"mgpu.report: experiment {experiment!r} holds no sweep (mgpu -m ...)")
    return sweeps[0]


def sweep_children(client: MlflowClient, parent: Run) -> list[Run]:
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"],
    )
    if not runs:
        raise SystemExit(f"mgpu.report: sweep run {parent.info.run_id} has no job runs")
    return runs


def swept_keys(parent: Run) -> list[str]:
    """The keys the sweep varied, from its overrides (`optim.lr=1e-3,3e-3` → `optim.lr`)."""
    overrides = parent.data.tags.get("mgpu.overrides", "").split()
    return [o.split("=", 1)[0].lstrip("+~") for o in overrides if "," in o.split("=", 1)[-1]]


def config_value(run: Run, key: str) -> str:
    """A group's choice (tag) or a config key's value (param); '' where the run has neither."""
    if key in GROUPS or key == "experiment":
        return run.data.tags.get(key, "")
    return run.data.params.get(key, "")


def build_table(parent: Run, runs: list[Run]) -> tuple[list[str], list[list]]:
    """Header and rows: job, status, config columns, then the metrics any run has."""
    swept = swept_keys(parent)
    config = list(dict.fromkeys([*swept, *CONFIG_COLUMNS]))
    config = [k for k in config if any(config_value(r, k) for r in runs)]
    metrics = [m for m in METRIC_COLUMNS if any(m in r.data.metrics for r in runs)]
    timed = ["timing"] if "host/other_cpu_fraction" in metrics else []
    header = ["job", "status", *config, *metrics, *timed]
    rows = [
        [" ".join(f"{k}={config_value(r, k)}" for k in swept) or r.info.run_name, r.info.status,
         *(config_value(r, k) for k in config),
         *(r.data.metrics.get(m, "") for m in metrics),
         *(timing(r) for _ in timed)]
        for r in runs
    ]
    return header, rows


def _cell(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_markdown(path: Path, parent: Run, header: list[str], rows: list[list]) -> None:
    lines = [
        f"# {parent.info.run_name[:1].upper()}{parent.info.run_name[1:]}",  # "sweep <overrides>"
        "",
        f"Parent run `{parent.info.run_id}`, {len(rows)} job runs.",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
        *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows),
    ]
    path.write_text("\n".join(lines) + "\n")


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def plot_throughput_vs_accuracy(path: Path, runs: list[Run]) -> bool:
    """samples/s (x) against eval accuracy (y), one panel per group, points by its options."""
    runs = [r for r in runs if {"train/samples_per_s", "eval/accuracy"} <= r.data.metrics.keys()]
    present = [g for g in PLOT_GROUPS if any(g in r.data.tags for r in runs)]
    varied = [g for g in present if len({r.data.tags.get(g) for r in runs}) > 1]
    groups = varied or present[:1]  # a panel per group the sweep varied
    if not runs or not groups:
        return False
    fig = Figure(figsize=(5 * len(groups), 4), layout="tight")
    axes = fig.subplots(1, len(groups), squeeze=False)
    for ax, group in zip(axes[0], groups, strict=True):
        for option in sorted({r.data.tags.get(group, "?") for r in runs}):
            chosen = [r for r in runs if r.data.tags.get(group, "?") == option]
            ax.scatter([r.data.metrics["train/samples_per_s"] for r in chosen],
                       [r.data.metrics["eval/accuracy"] for r in chosen], label=option)
        ax.set(title=f"by {group}", xlabel="train/samples_per_s", ylabel="eval/accuracy")
        ax.legend()
    fig.savefig(path, dpi=100)
    return True


def plot_scaling(path: Path, runs: list[Run]) -> bool:
    """samples/s against world size, one line per strategy, where the world size varies."""
    # An elastic run's param is a range ("1:2"): it ran at more than one size.
    runs = [r for r in runs if "train/samples_per_s" in r.data.metrics
            and r.data.params.get("launch.world_size", "").isdigit()]
    if len({r.data.params["launch.world_size"] for r in runs}) < 2:
        return False
    fig = Figure(figsize=(5, 4), layout="tight")
    ax = fig.subplots()
    for strategy in sorted({r.data.tags.get("strategy", "?") for r in runs}):
        points = sorted(
            (int(r.data.params["launch.world_size"]), r.data.metrics["train/samples_per_s"])
            for r in runs if r.data.tags.get("strategy", "?") == strategy
        )
        ax.plot(*zip(*points, strict=True), marker="o", label=strategy)
    ax.set(title="scaling", xlabel="world size", ylabel="train/samples_per_s")
    ax.legend()
    fig.savefig(path, dpi=100)
    return True


STEP_TIME, STATE_BYTES = "step time (s)", "state bytes per rank"


def calibration_points(run: Run) -> dict[str, tuple[float, float]]:
    """(predicted, measured) step time and state bytes per rank, where the run logged the
    planner's figures beside its own. Measured step time is `time/step_p50_s`; measured state
    is the largest parameter plus the largest optimizer bytes of a rank, and its prediction
    the one `plan/error_state_bytes` was computed from (predicted / measured - 1)."""
    metrics = run.data.metrics
    points = {}
    if PREDICTED_STEP in metrics and metrics.get("time/step_p50_s"):
        points[STEP_TIME] = (metrics[PREDICTED_STEP], metrics["time/step_p50_s"])
    if ERROR_STATE in metrics and metrics.get("memory/param_bytes_per_rank"):
        measured = (metrics["memory/param_bytes_per_rank"]
                    + metrics.get("memory/optimizer_bytes_per_rank", 0.0))
        points[STATE_BYTES] = ((1 + metrics[ERROR_STATE]) * measured, measured)
    return points


def plot_calibration(path: Path, runs: list[Run]) -> bool:
    """Predicted (x) against measured (y) step time and state bytes per rank, one point per
    run by strategy, beside the line where they agree: how far off the planner was for each
    layout the sweep ran. False (no file) where no run logged the planner's figures."""
    points = [(r.data.tags.get("strategy", "?"), calibration_points(r)) for r in runs]
    panels = [p for p in (STEP_TIME, STATE_BYTES) if any(p in figures for _, figures in points)]
    if not panels:
        return False
    fig = Figure(figsize=(5 * len(panels), 4), layout="tight")
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        pairs = [(strategy, figures[panel]) for strategy, figures in points if panel in figures]
        for strategy in sorted({strategy for strategy, _ in pairs}):
            chosen = [xy for s, xy in pairs if s == strategy]
            ax.scatter(*zip(*chosen, strict=True), label=strategy)
        values = [v for _, xy in pairs for v in xy]
        ax.plot([min(values), max(values)], [min(values), max(values)], linestyle="--",
                color="grey", label="predicted = measured")
        ax.set(title=panel, xlabel=f"predicted {panel}", ylabel=f"measured {panel}",
               xscale="log", yscale="log")
        ax.legend()
    fig.savefig(path, dpi=100)
    return True


def report(uri: str, experiment: str | None, run_id: str | None, out: Path | None) -> Path:
    """Write the sweep's table and plots, log them to its parent run; returns the directory."""
    client = MlflowClient(uri)
    parent = find_sweep(client, experiment, run_id)
    out = out or Path("reports") / parent.info.run_id
    write_report(client, parent, sweep_children(client, parent), out)
    return out


def summarize_sweep(uri: str, parent_run_id: str, metric: str, direction: str, out: Path) -> None:
    """The sweep's comparison on its parent run, where the MLflow UI shows the sweep: the
    report's table and plots, the best job (tags `mgpu.best_run`, `mgpu.best_job` and the
    metric `best/<metric>`) and the params every job shared."""
    client = MlflowClient(uri)
    parent = client.get_run(parent_run_id)
    runs = sweep_children(client, parent)
    write_report(client, parent, runs, out)
    records = param_records(uri, parent_run_id, shared_params(runs))
    best = best_run(runs, metric, direction)
    if best is not None:
        job = " ".join(f"{k}={config_value(best, k)}" for k in swept_keys(parent))
        records.append(record(uri, parent_run_id, tags=tags_within_limits({
            "mgpu.best_run": best.info.run_id, "mgpu.best_job": job or best.info.run_name})))
        records.append(record(uri, parent_run_id, metrics=[
            [f"best/{metric}", best.data.metrics[metric], int(time.time() * 1000), 0]]))
    for entry in records:
        write_record(entry)


def best_run(runs: list[Run], metric: str, direction: str) -> Run | None:
    """The FINISHED job with the best `metric` (`direction`: maximize or minimize), if any."""
    scored = [r for r in runs if r.info.status == "FINISHED" and metric in r.data.metrics]
    if not scored:
        return None
    pick = max if direction == "maximize" else min
    return pick(scored, key=lambda r: r.data.metrics[metric])


def shared_params(runs: list[Run]) -> dict[str, str]:
    """The params every job logged with one value: what the sweep held fixed."""
    first, *rest = (r.data.params for r in runs)
    return {k: v for k, v in sorted(first.items()) if all(p.get(k) == v for p in rest)}


def write_report(client: MlflowClient, parent: Run, runs: list[Run], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    header, rows = build_table(parent, runs)
    write_markdown(out / "report.md", parent, header, rows)
    write_csv(out / "report.csv", header, rows)
    plot_throughput_vs_accuracy(out / "throughput_vs_accuracy.png", runs)
    plot_scaling(out / "scaling.png", runs)
    plot_calibration(out / "calibration.png", runs)
    client.log_artifacts(parent.info.run_id, str(out), artifact_path="report")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--experiment", help="MLflow experiment name: report its latest sweep")
    which.add_argument("--run", help="the sweep's parent run id")
    parser.add_argument("--out", type=Path, help="directory (default reports/<parent run id>)")
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else ./mlflow.db")
    args = parser.parse_args(argv)
    out = report(resolve_tracking_uri(args.tracking_uri), args.experiment, args.run, args.out)
    print(f"mgpu.report: {out}/report.md, report.csv and plots; logged to the parent run",
          file=sys.stdout)


if __name__ == "__main__":
    main()
