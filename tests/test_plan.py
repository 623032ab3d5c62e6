"""The planner (mgpu.plan) against what real layouts hold: parameter, gradient and optimizer
bytes per rank measured on each rank of a launched group after one real step, and the peak
bytes of a step."""

from __future__ import annotations

import dataclasses
import gc

import pytest
from mlflow.tracking import MlflowClient
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from mgpu.config import prepare
from mgpu.job import Job
from mgpu.meter import local_bytes, optimizer_state_bytes
from mgpu.options import Options
from mgpu.parallel import DDPOptions
from mgpu.pipeline import schedule_class, stage_ids
from mgpu.plan import candidates, plan_job
from mgpu.plan.machine import DEFAULT_LINKS, Machine
from mgpu.plan.memory import StandInStage, single_stage_actions
from mgpu.runtime import init_runtime, shutdown
from mgpu.trainer import Trainer
from tests.conftest import assert_refused, compose_config, launch_ranks, make_job, mlflow_runs

pytestmark = pytest.mark.timeout(900)
ONE_STEP = ["train.steps=1", "train.warmup_steps=0", "train.log_every=1", "eval.every_steps=0",
            "checkpoint.every_steps=0"]
GPT = ["model=gpt", "model.dim=32", "model.mlp_ratio=2"]
#: A stated machine: memory predictions do not depend on it.
MACHINE = Machine(1e9, dict.fromkeys(("all_reduce", "all_gather", "reduce_scatter", "broadcast"),
                                     DEFAULT_LINKS["cpu"]), "test")


def job_and_options(overrides: list[str], tmp_path) -> tuple[Job, Options]:
    job = make_job(overrides, tmp_path)
    return job, Options.of(job.groups())


def prepared(overrides: list[str], tmp_path) -> tuple[Job, Options]:
    """The job and the options `prepare` built (with what strategy=auto planned)."""
    cfg = compose_config([*overrides, f"output_dir={tmp_path}", "tracking.enabled=false"])
    return prepare(cfg, cuda_devices=0, torchrun_world=None)


def state_layout(candidate) -> tuple:
    """What decides where parameters and optimizer state live (not micro-batches, recompute,
    resharding after forward or offload, which move no state between ranks)."""
    plan = candidate.plan
    held = ()  # the stages each pipeline rank holds (looped, or in a V)
    if plan.pipeline:
        held = tuple(tuple(stage_ids(plan.pipeline.schedule, r, plan.pp)) for r in range(plan.pp))
    zero = candidate.strategy.shards_optimizer and isinstance(plan.data_parallel, DDPOptions)
    return (plan.pp, plan.dp_replicate, plan.dp_shard, plan.tp,
            type(plan.data_parallel).__name__, held, zero)


def measure_layouts(job: Job, nodes: list[dict]) -> list[dict[str, int]]:
    """Per rank: each strategy node built and trained one step in one process group; the bytes
    of this rank's parameters, gradients and optimizer state (local shards), read just before
    the step's zero_grad frees the gradients."""
    runtime = init_runtime(job.output_dir, 120)
    measured = []
    try:
        for node in nodes:
            trainer = Trainer.build(dataclasses.replace(job, strategy=node), runtime, None)
            held: dict[str, int] = {}
            clear = trainer.optimizer.zero_grad

            def read_then_clear(*args, trainer=trainer, held=held, clear=clear, **kwargs):
                params = list(trainer.model.parameters())
                held["params"] = sum(local_bytes(p) for p in params)
                held["grads"] = sum(local_bytes(p.grad) for p in params if p.grad is not None)
                held["optimizer"] = optimizer_state_bytes(trainer.optimizer)
                return clear(*args, **kwargs)

            trainer.optimizer.zero_grad = read_then_clear
            trainer.train_step()
            trainer.close()
            measured.append(held)
            del trainer
    finally:
        shutdown()
    return measured


@pytest.mark.dist
@pytest.mark.parametrize(("ranks", "model", "optim"), [
    (2, ["model=mlp"], "adamw"), (2, ["model=cnn"], "sgd"), (2, GPT, "adamw"), (4, GPT, "sgd"),
    (4, ["model=mlp", "model.hidden=[64,64,64,64]"], "adamw"),
], ids=["2-mlp-adamw", "2-cnn-sgd", "2-gpt-adamw", "4-gpt-sgd", "4-mlp-adamw"])
def test_predicted_state_bytes_per_rank_match_measured(ranks, model, optim, tmp_path):
    """Every candidate the rules allow: predicted parameter + gradient + optimizer bytes of
    each rank within 2% of what that rank holds after one real step. Candidates that place
    state alike (they differ in micro-batches, recompute, resharding or offload) are predicted
    alike, and one of each is measured."""
    job, options = job_and_options(
        [*model, f"optim={optim}", f"launch.nproc_per_node={ranks}", *ONE_STEP], tmp_path)
    rows = plan_job(job, options, MACHINE, None)
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(state_layout(row.candidate), []).append(row)
    for same in groups.values():
        assert all(r.state_per_rank == same[0].state_per_rank for r in same), same
    chosen = [same[0] for same in groups.values()]
    results = launch_ranks(measure_layouts, job.launch.world_size, "plan", job,
                           [row.candidate.node for row in chosen])
    for i, row in enumerate(chosen):
        for rank in range(ranks):
            held = results[rank][i]
            measured = held["params"] + held["grads"] + held["optimizer"]
            predicted = row.state_per_rank[rank]
            assert predicted == pytest.approx(measured, rel=0.02), (
                row.candidate.name, rank, held, predicted)


def allocations(prof: profile) -> list[tuple[int, int, int]]:
    """(time, bytes: + allocated, - freed, address) of every CPU allocation the profile saw."""
    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            found.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].ptr))
    return sorted(found)


def marks(prof: profile) -> dict[str, tuple[int, int]]:
    """(start, end) of each `record_function` range of the profile, by name."""
    found, stack = {}, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        found[event.name] = (event.start_time_ns, event.end_time_ns)
    return found


def step_peak(job: Job, node: dict, runtime) -> int:
    """The most bytes allocated at once during the second training step of `job` run with the
    strategy `node` (the first made the optimizer state), counting all the run allocated since
    its build began, less its data set: what a device would hold. The CPU allocator keeps no
    peak: torch.profiler's memory events (each allocation and free, by address) are summed in
    time order; a free of a tensor allocated before the profile is left out. The profiler
    records the profiling thread's events only: a tensor whose last reference a gloo thread
    drops (a collective's buffer) is freed unrecorded, and an allocation at its address says
    it was."""
    job = dataclasses.replace(job, strategy=node)
    options = Options.of(job.groups())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("plan.data"):
            splits = options.data.splits(job.seed)  # as much as the build's copy of the data
        del splits
        trainer = Trainer.build(job, runtime, None, options)
        trainer.train_step()
        gc.collect()  # the build's garbage (meta copies, the model before it was split)
        with record_function("plan.step"):
            trainer.train_step()
        trainer.close()
    ranges = marks(prof)
    live, data, peak, known = 0, 0, 0, {}
    for t, size, ptr in allocations(prof):
        if size < 0 and known.pop(ptr, None) is None:
            continue  # allocated before the profile began
        if size > 0:
            live -= known.pop(ptr, 0)  # freed on a thread the profiler does not record
            known[ptr] = size
        live += size
        if t <= ranges["plan.data"][1]:
            data = live
        if ranges["plan.step"][0] <= t <= ranges["plan.step"][1]:
            peak = max(peak, live)
    return peak - data


def measure_peaks(job: Job, nodes: list[dict], repeats: int) -> list[int]:
    """Per rank: each strategy node's step peak (`step_peak`), the least of `repeats` fresh
    builds: a free the profiler misses (one on a thread it does not record, its address not
    yet reused) can only raise a measurement."""
    runtime = init_runtime(job.output_dir, 120)
    try:
        return [min(step_peak(job, node, runtime) for _ in range(repeats)) for node in nodes]
    finally:
        shutdown()


#: The layouts whose predicted peak bytes per rank hold within 15% on CPU, each measured between
#: 0.89 and 1.10 of its prediction (README, "strategy=auto and the planner", says where the
#: estimate does not hold).
PP = "strategy=pp strategy.schedule="
PEAK_LAYOUTS = {
    # zero1 on this mlp measures 0.34 MB high in some builds (rank 0: 1.93 MB, not 1.59 MB): the
    # buckets DDP replaces at its second step are freed on gloo's thread, unrecorded, and their
    # addresses not reused before the peak. ddp replaces its buckets alike. Both are asserted
    # on the other jobs.
    "2-mlp-adamw": (2, ["model=mlp"], "adamw", [
        "strategy=tp",
        *(f"{PP}{schedule} strategy.microbatches=4" for schedule in ("gpipe", "1f1b")),
    ]),
    "2-cnn-sgd": (2, ["model=cnn"], "sgd", [
        "strategy=ddp", "strategy=zero1", "strategy=ddp strategy.activation_checkpointing=full",
        "strategy=fsdp strategy.reshard_after_forward=true strategy.cpu_offload=false",
        f"{PP}gpipe strategy.microbatches=4",
    ]),
    "2-gpt-adamw": (2, GPT, "adamw", [
        "strategy=ddp", "strategy=zero1", "strategy=ddp strategy.activation_checkpointing=full",
        "strategy=fsdp strategy.reshard_after_forward=true strategy.cpu_offload=false",
        "strategy=tp",
        *(f"{PP}{schedule} strategy.microbatches=4" for schedule in (
            "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv",
            "dualpipev")),
        *(f"{PP}{schedule} strategy.microbatches=4 strategy.activation_checkpointing=full"
          for schedule in ("gpipe", "1f1b", "interleaved_zb", "zbv", "dualpipev")),
        f"{PP}interleaved_1f1b strategy.microbatches=8 strategy.activation_checkpointing=full",
    ]),
    "4-mlp-adamw": (4, ["model=mlp", "model.hidden=[64,64,64,64]"], "adamw", [
        "strategy=tp", "strategy=fsdp strategy.reshard_after_forward=false "
        "strategy.cpu_offload=false",
        "strategy=hybrid strategy.dp=1 strategy.tp=2 strategy.pp=2 strategy.schedule=1f1b "
        "strategy.microbatches=8 strategy.activation_checkpointing=full",
    ]),
    "4-gpt-sgd": (4, GPT, "sgd", [
        "strategy=ddp", "strategy=zero1 strategy.activation_checkpointing=full",
        "strategy=fsdp strategy.reshard_after_forward=true strategy.cpu_offload=false",
        "strategy=fsdp strategy.reshard_after_forward=true strategy.cpu_offload=false "
        "strategy.activation_checkpointing=full",
        f"{PP}gpipe strategy.microbatches=16 strategy.activation_checkpointing=full",
        "strategy=hybrid strategy.dp=2 strategy.tp=1 strategy.pp=2 strategy.schedule=1f1b "
        "strategy.microbatches=2 strategy.activation_checkpointing=full",
        "strategy=tp", f"{PP}1f1b strategy.microbatches=8",
        "strategy=hybrid strategy.dp=2 strategy.tp=2 strategy.pp=1",
        *(f"strategy=hybrid strategy.dp=2 strategy.tp=1 strategy.pp=2 strategy.schedule={schedule} "
          "strategy.microbatches=4" for schedule in ("gpipe", "interleaved_1f1b")),
        "strategy=hybrid strategy.dp=1 strategy.tp=2 strategy.pp=2 strategy.schedule=1f1b "
        "strategy.microbatches=4",
    ]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", PEAK_LAYOUTS)
def test_predicted_peak_bytes_per_rank_match_measured(case, tmp_path):
    """Predicted device bytes of each rank (state, activations, communication buffers) within
    15% of the most the rank allocated at once during a real step."""
    ranks, model, optim, names = PEAK_LAYOUTS[case]
    job, options = job_and_options(
        [*model, f"optim={optim}", f"launch.nproc_per_node={ranks}", *ONE_STEP], tmp_path)
    rows = {row.candidate.name: row for row in plan_job(job, options, MACHINE, None)}
    chosen = [rows[name] for name in names]
    results = launch_ranks(measure_peaks, ranks, "peaks", job,
                           [row.candidate.node for row in chosen], 2)
    for i, row in enumerate(chosen):
        for rank in range(ranks):
            measured, predicted = results[rank][i], row.ranks[rank].device
            assert predicted == pytest.approx(measured, rel=0.15), (
                row.candidate.name, rank, predicted, measured)


def test_offloaded_state_leaves_a_gpus_memory_and_stays_in_a_cpus(tmp_path):
    """FSDP's cpu_offload moves parameters, gradients and optimizer state to the host: off a
    GPU's memory, but on a CPU the host's memory is the device's and the state still counts."""
    job, options = job_and_options(["model=mlp", "launch.nproc_per_node=2"], tmp_path)
    gpu = dataclasses.replace(MACHINE, device_type="cuda")
    fsdp = "strategy=fsdp strategy.reshard_after_forward=true strategy.cpu_offload="
    for machine, offload_frees in ((gpu, True), (MACHINE, False)):
        rows = {r.candidate.name: r for r in plan_job(job, options, machine, None)}
        kept, offloaded = rows[f"{fsdp}false"].ranks[0], rows[f"{fsdp}true"].ranks[0]
        assert offloaded.state == kept.state
        freed = kept.device - offloaded.device
        assert freed >= offloaded.state if offload_frees else freed <= 0, (machine, freed)


def test_candidates_are_the_layouts_the_rules_allow(tmp_path):
    """gpt at 4 ranks: every strategy family, each with and without recompute; cnn has no
    tensor-parallel plan, so only data-parallel and pipeline layouts."""
    job, options = job_and_options([*GPT, "launch.nproc_per_node=4"], tmp_path)
    names = [c.name for c in candidates(job, options)]
    for family in ("strategy=ddp", "strategy=zero1", "strategy=fsdp", "strategy=tp",
                   "strategy=pp", "strategy=hybrid strategy.dp=2 strategy.tp=2 strategy.pp=1"):
        assert any(n.startswith(family) for n in names), family
    assert "strategy=ddp strategy.activation_checkpointing=full" in names
    job, options = job_and_options(["model=cnn", "launch.nproc_per_node=2"], tmp_path)
    families = {c.option for c in candidates(job, options)}
    assert families == {"ddp", "zero1", "fsdp", "pp"}


def test_auto_resolves_to_the_fastest_predicted_layout_that_fits(tmp_path):
    """strategy=auto plans in `prepare`: the job's strategy is the first row's concrete node
    (workers never see auto), and the plan stays with the options for the run's record."""
    job, options = prepared(["strategy=auto", *GPT, "launch.nproc_per_node=4"], tmp_path)
    assert job.strategy["_target_"] != "mgpu.strategy.auto.Auto"
    rows = options.planned.rows
    assert rows[0].fits and rows[0].candidate.node == job.strategy
    assert [r.time.seconds for r in rows] == sorted(r.time.seconds for r in rows)


def test_a_memory_limit_no_layout_fits_names_the_smallest_layouts_need(tmp_path):
    """The smallest on CPU, where offloading to the host frees nothing (the host's memory is
    the device's): tensor parallelism, each rank holding half of every layer's weights, their
    gradients and AdamW's state."""
    assert_refused(["strategy=auto", "strategy.memory_limit=1000"], (
        "strategy.memory_limit=1000: no layout of 2 ranks fits 1,000 bytes per rank; the "
        "smallest, strategy=tp, needs 979,640 bytes per rank; raise "
        "strategy.memory_limit, use more ranks or a smaller model"), tmp_path)


@pytest.mark.e2e
def test_auto_with_trials_times_them_as_child_runs_and_records_its_choice(cli, tmp_path):
    """strategy=auto strategy.trials=2: two child runs tagged mgpu.trial under the job's run,
    the job's run tagged with the choice (one of the two timed), the plan table as an
    artifact, and the planner's prediction with its error beside what the run measured."""
    result = cli("strategy=auto", "strategy.trials=2", "strategy.trial_steps=4",
                 "train.steps=6", "train.warmup_steps=2", "eval.every_steps=0",
                 "checkpoint.every_steps=0")
    assert result.returncode == 0, result.stderr
    runs = mlflow_runs(tmp_path)
    trials = [r for r in runs if "mgpu.trial" in r.data.tags]
    [job] = [r for r in runs if "mgpu.trial" not in r.data.tags]
    assert len(trials) == 2
    assert all(t.data.tags["mlflow.parentRunId"] == job.info.run_id for t in trials)
    assert job.data.tags["mgpu.plan.choice"] in {t.data.tags["mgpu.trial"] for t in trials}
    assert job.data.tags["mgpu.plan.chosen_by"] == "trials"
    assert job.data.tags["strategy"] == "auto"
    for run in (job, *trials):
        for key in ("plan/predicted_step_seconds", "plan/predicted_bytes_per_rank",
                    "plan/error_step_time", "plan/error_state_bytes"):
            assert key in run.data.metrics, (key, run.data.tags)
    table = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").download_artifacts(
        job.info.run_id, "plan/plan.txt", str(tmp_path))
    assert job.data.tags["mgpu.plan.choice"] in open(table).read()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_stage_orders_are_torchs(schedule):
    """The planner's GPipe and 1F1B orders (which torch 2.6's schedules do not expose) are
    the forwards and backwards, in order, of this torch's own `pipeline_order`."""
    for ranks in (2, 4):
        for microbatches in (ranks, 2 * ranks, 8):
            for rank in range(ranks):
                built = schedule_class(schedule)(StandInStage(rank, ranks, rank, ranks),
                                                 n_microbatches=microbatches)
                torchs = tuple((a.computation_type.value, a.stage_index)
                               for a in built.pipeline_order[rank]
                               if a is not None and a.computation_type.value in ("F", "B"))
                assert single_stage_actions(schedule == "gpipe", ranks, microbatches,
                                            rank) == torchs, (ranks, microbatches, rank)
