"""The support matrix as a test tier: every combination the config accepts trains correctly,
every other is refused before launch with one line naming both keys.

The combinations are `mgpu.matrix`'s covering array: together they hold every supported pair
of options of strategy, precision, compression, balance, model and train.grad_accum. Each
supported one is a short real run on its world size's gloo group, checked after every step
(every rank holds the same value of every parameter it shares with another rank; the loss is
finite and falls), at the end (every rank predicts the same logits for the same inputs), and
across a SIGKILL: the group is killed after the checkpoint, restarted by the launcher, resumes
every combination from its checkpoint and must end bitwise where the uninterrupted run ended
(loss at every redone step, eval metrics, each rank's parameters and optimizer state) — or,
where a balance declares itself not deterministic (its split follows measured time), within
the stated bound.

Consistent is not yet right: an error every rank shares passes all of that. So each
uninterrupted run is also checked against a single-process reference of the same math
(`tests.oracle`), computed from the micro-batches each rank read: the exact cells against the
gradient of the global batch, the approximate ones (a low-precision wire, onebit, PowerSGD,
ssp, amp's loss scale) against a reference applying the same rule, within a bound derived
from the dtypes the cell rounds in.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.tensor import DTensor

from mgpu.job import Job
from mgpu.launch import WORKER_ENV, environment
from mgpu.matrix import (
    BEGIN,
    END,
    axis_options,
    cell_name,
    covering_rows,
    overrides,
    refused_rows,
    render,
)
from mgpu.options import build
from mgpu.pipeline import SCHEDULES
from mgpu.precision.padding import WRAPPER_NAMES
from mgpu.runtime import init_runtime, shutdown
from mgpu.support import AXES, GRAD_ACCUM_KEY, RULES, Option
from mgpu.trainer import Trainer
from tests.conftest import ROOT, assert_refused, make_job
from tests.oracle import (
    Recorder,
    autocast,
    initial_model,
    reference,
    relative_error,
    tolerance,
)

# Under pytest-xdist the tier's runs go in one group per world size (`by_world_size`): the
# worker that takes a group launches its world size once for all of its cells.
pytestmark = pytest.mark.xdist_group("matrix")

STEPS, CHECKPOINT_AT = 10, 6  # resumed runs redo steps 7..10
# SGD, not AdamW, for the reference: AdamW's update is nearly blind to the gradient's scale and
# turns rounding noise on near-zero gradients into lr-sized steps, so it hides wrong answers.
RUN = [f"train.steps={STEPS}", "train.warmup_steps=2", "train.log_every=5",
       "eval.every_steps=0", f"checkpoint.every_steps={CHECKPOINT_AT}", "checkpoint.keep_last=1",
       "launch.timeout_s=120", "optim=sgd"]
# Per option: settings that make it act within 10 steps (warm-ups) and keep the run small.
SHORT = {
    "model=gpt": ["model.dim=32", "model.mlp_ratio=2"],
    "data=text": ["data.seq_len=16", "data.val_samples=32"],
    "data=synthetic": ["data.noise=0.2"],  # classes apart enough for the loss to fall in 10 steps
    "model=cnn": ["model.channels=[8,16]", "model.hidden=32"],
    # The scale overflows at once and backs off, then grows every 2 clean steps: both happen
    # within the first steps, where the reference follows every change of scale.
    "precision=amp": ["precision.init_scale=262144", "precision.growth_interval=2"],
    # Four ranks: onebit's compressed all-reduce (two ranks gather every message instead).
    "compression=onebit": ["compression.warmup_steps=2", "launch.nproc_per_node=4"],
    "compression=powersgd": ["compression.start_powerSGD_iter=2"],
    "balance=throughput": ["balance.warmup_steps=3", "balance.rebalance_every=2"],
    "balance=thermal": ["balance.warmup_steps=3", "balance.rebalance_every=2"],
}

OPTIONS = axis_options()
RUNS = {cell_name(row): row for row in covering_rows(OPTIONS)}
REFUSED = refused_rows(OPTIONS)

#: Every pipeline schedule but the covering rows' own (1f1b), each on one pp row of gpt on text
#: (the tied embedding the first and the last stage share sits twice on rank 0 in a V), fp32
#: and bf16 by turns (a stale schedule, 2bw, under both: its update is its own), in a shorter
#: run (resumed runs redo steps 5..6). The schedule is not an axis of the support matrix: these
#: rows come on top of the covering ones.
SCHEDULE_ROW = {"strategy": "strategy=pp", "compression": "compression=none",
                "balance": "balance=none", "model": "model=gpt", "data": "data=text",
                "grad_accum": f"{GRAD_ACCUM_KEY}=1"}
SCHEDULE_RUN = ["train.steps=6", "checkpoint.every_steps=4"]


def schedule_rows() -> dict[str, dict[str, Option]]:
    """name → row: each schedule but 1f1b on SCHEDULE_ROW, fp32 and bf16 by turns (a stale
    schedule under both)."""
    by_name = {o.name: o for options in OPTIONS.values() for o in options}
    others = [schedule for schedule in SCHEDULES if schedule != "1f1b"]
    precisions = ("precision=fp32", "precision=bf16")
    rows = {}
    for turn, schedule in enumerate(others):
        for precision in precisions if SCHEDULES[schedule].stale else precisions[turn % 2:][:1]:
            row = {axis: by_name[{**SCHEDULE_ROW, "precision": precision}[axis]] for axis in AXES}
            row["schedule"] = Option("schedule", f"strategy.schedule={schedule}", None)
            rows[f"{cell_name(row)}-{schedule}"] = row
    return rows


RUNS.update(schedule_rows())


def by_world_size() -> list:
    """Every run's name, in the xdist group of its world size."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(f"matrix-{cell_world_size(row)}"))
            for name, row in RUNS.items()]


#: Where a balance splits the batch by speed and several ranks share it: the last rank three
#: times slower, so the shares become uneven within the run and the reference weighs them.
STRAGGLER = "straggler.slowdown="


def short_overrides(row) -> list[str]:
    return [s for option in row.values() for s in SHORT.get(option.name, [])]


def cell_world_size(row) -> int:
    """The ranks a cell starts (`test_supported_combination_composes` checks it against the
    composed job): a strategy of a fixed size (hybrid: dp x tp x pp, single) that many, else
    what SHORT asks for, else two."""
    return row["strategy"].declares("world_size") or (
        4 if "launch.nproc_per_node=4" in short_overrides(row) else 2)


def cell_overrides(row) -> list[str]:
    short = short_overrides(row)
    uneven = row["balance"].declares("uneven") and row["strategy"].name != "strategy=single"
    ranks = cell_world_size(row)
    straggler = [f"{STRAGGLER}[{','.join(['1.0'] * (ranks - 1) + ['3.0'])}]"]
    # A pipeline's last stage slowed too: the simulation must reach each stage's compute.
    slowed = uneven or row["strategy"].declares("pipelined")
    schedule = [o.name for axis, o in row.items() if axis not in AXES]  # a schedule row's
    run = RUN
    if schedule:  # its shorter run in place of RUN's lengths
        lengths = {o.partition("=")[0] for o in SCHEDULE_RUN}
        run = [o for o in RUN if o.partition("=")[0] not in lengths] + SCHEDULE_RUN
    return [*overrides(row), *run, *short, *(straggler if slowed else []), *schedule]


# ---- the matrix itself -----------------------------------------------------------------------


def test_readme_holds_the_current_matrix():
    readme = (ROOT / "README.md").read_text()
    current = readme[readme.index(BEGIN) : readme.index(END) + len(END)]
    fix = "python -m mgpu.matrix --write README.md"
    assert current == render(), f"the README's matrix is stale: {fix}"


def test_covering_rows_hold_every_supported_pair_and_run_together():
    from mgpu.matrix import pairs, supported_and_refused

    supported, refused = supported_and_refused(OPTIONS)
    covered = set().union(*(pairs(row) for row in RUNS.values()))
    assert covered == supported
    assert not covered & set(refused)
    assert {pair for row, _ in REFUSED for pair in pairs(row)} >= set(refused)


def test_a_hybrid_pair_runs_where_one_shape_runs_and_other_shapes_stay_refused(tmp_path):
    """hybrid x cnn is supported (hybrid dp=2 runs it); a job asking for a shape with
    tensor parallelism is still refused before launch, naming the torch limit."""
    from mgpu.matrix import supported_and_refused

    supported, _ = supported_and_refused(OPTIONS)
    assert ("strategy=hybrid", "model=cnn") in supported
    assert any(row["strategy"].name == "strategy=hybrid" and row["model"].name == "model=cnn"
               for row in RUNS.values())
    line = assert_refused(["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "model=cnn"],
                          "strategy=hybrid cannot run with model=cnn", tmp_path)
    assert "Linear and Embedding layers only" in line


def test_an_uneven_split_runs_on_fsdp_data_parallel_and_not_with_tensor_parallel_peers(tmp_path):
    """hybrid x throughput is supported (hybrid dp=2 splits its batch, as fsdp does); with
    tensor-parallel peers it is refused before launch, naming why no step time is a rank's own."""
    from mgpu.matrix import supported_and_refused

    supported, _ = supported_and_refused(OPTIONS)
    assert {("strategy=fsdp", "balance=throughput"),
            ("strategy=hybrid", "balance=thermal")} <= supported
    line = assert_refused(["strategy=hybrid", "strategy.dp=2", "strategy.tp=2",
                           "balance=throughput"],
                          "balance=throughput cannot run with strategy=hybrid", tmp_path)
    assert "wait for each other inside every layer" in line


def test_each_refusal_names_the_fact_behind_it():
    """A refusal says why the pair cannot run in torch's or the machine's terms, not only that
    an option lacks a declaration."""
    facts = {
        ("strategy=tp", "compression=bf16"): "no gradient all-reduce runs",
        ("strategy=pp", "balance=throughput"): "read the same samples",
        ("strategy=fsdp", "compression=onebit"): "FSDP2 has no comm hook for its reduce-scatter",
        ("strategy=single", "balance=ssp"): "one process has no gradients to exchange",
        ("balance=throughput", "model=cnn"): "SyncBatchNorm",
        ("strategy=tp", "model=cnn"): "Linear and Embedding layers only",
    }
    for row, reason in REFUSED:
        names = {option.name for option in row.values()}
        for pair, fact in facts.items():
            if set(pair) <= names and all(name in reason for name in pair):
                assert fact in reason, reason


def test_each_rule_summary_names_the_fact_behind_it():
    """The README's list of rules (each rule's summary) says, for every pair a rule refuses,
    which torch or machine fact it rests on."""
    facts = {
        "compression_needs_a_comm_hook": ["one process", "no gradient all-reduce",
                                          "FSDP2 has no reduce-scatter comm hook"],
        "balance_needs_a_comm_hook": ["one process", "FSDP2 has no hook", "no gradient "
                                      "all-reduce"],
        "one_comm_hook": ["register_comm_hook"],
        "uneven_batches_need_local_steps": ["inside every layer", "read the same samples"],
        "uneven_batches_change_batch_statistics": ["SyncBatchNorm", "CPU"],
        "strategy_needs_a_model_plan": ["Linear and Embedding layers only"],
        "token_data_needs_a_language_model": ["one prediction per sample"],
    }
    for rule in RULES:
        for fact in facts[rule.refusal.__name__]:
            assert fact in rule.summary, (rule.refusal.__name__, fact)


@pytest.mark.dist
def test_sync_batch_norm_refuses_cpu_tensors(one_rank_group):
    """The torch fact behind rule 5: SyncBatchNorm, which would normalise over the global batch
    whatever the split, refuses the CPU tensors gloo runs compute on. Where this fails, torch
    runs it on CPU: convert the cnn's BatchNorm under an uneven balance and lift the rule."""
    with pytest.raises(ValueError, match="expected input tensor to be on GPU"):
        torch.nn.SyncBatchNorm(4)(torch.randn(3, 4, 5, 5))


@pytest.mark.parametrize(("row", "reason"), REFUSED, ids=[r for _, r in REFUSED])
def test_refused_combination_fails_composition_with_its_reason(row, reason, tmp_path):
    assert assert_refused(overrides(row), reason, tmp_path) == reason
    names = [o.name for o in row.values()]
    assert sum(name in reason for name in names) >= 2, "the reason must name both keys"


@pytest.mark.parametrize("name", RUNS)
def test_supported_combination_composes(name, tmp_path):
    job = make_job(cell_overrides(RUNS[name]), tmp_path)
    assert job.launch.world_size == cell_world_size(RUNS[name])


# ---- the runs: one gloo group per world size, every combination in turn ----------------------


def run_cells(jobs: dict[str, dict], results: str, timeout_s: int) -> None:
    """Per rank: each combination in turn on one process group. After the first attempt the
    last rank kills itself (SIGKILL): the launcher restarts the group, and every combination
    resumes from its checkpoint in a fresh process."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    runtime = init_runtime(results, timeout_s)
    failed = None
    try:
        for name, job in jobs.items():
            own = dataclasses.replace(runtime, output_dir=Path(job.output_dir))
            if failed:  # the group may be broken: don't wait out a timeout per combination
                record = {"error": f"not run: {failed} failed before it on this rank"}
            else:
                try:
                    record = train_cell(job, own)
                except Exception as e:  # recorded; the test of that combination reports it
                    record = {"error": f"{type(e).__name__}: {e}"}
                    failed = name
            torch.save(record, Path(results) / f"{name}.attempt{attempt}.rank{runtime.rank}.pt")
            gc.collect()
    finally:
        shutdown()
    if attempt == 0 and runtime.rank == runtime.world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)


def train_cell(job: Job, runtime) -> dict:
    """The real training loop, checked after every step; what the test compares afterwards."""
    trainer = Trainer.build(job, runtime, None)
    # The reference computes the steps again from what each rank read.
    steps, checkpoint_at = job.train.steps, job.checkpoint.every_steps
    recorder = Recorder(trainer.batches, steps - trainer.start_step, job.train.grad_accum)
    trainer.batches = recorder
    losses: dict[int, float] = {}
    samples_taken: dict[int, int] = {}
    diverged: list[int] = []
    # The stateful parts as restored (resumed run) or as saved at the checkpoint (first run).
    parts = stateful_parts(trainer) if trainer.start_step else None
    step_once = trainer.train_step

    def checked_step() -> tuple[torch.Tensor, int]:
        nonlocal parts
        loss_sum, samples = step_once()
        step = trainer.start_step + len(losses) + 1
        losses[step] = float(loss_sum) / samples
        samples_taken[step] = samples
        if not replicas_agree(trainer):
            diverged.append(step)
        if step == checkpoint_at:
            trainer.strategy.drain()  # as the checkpoint does first (a no-flush pipeline)
            parts = stateful_parts(trainer)
        return loss_sum, samples

    trainer.train_step = checked_step
    try:
        summary = trainer.train()
        layouts = getattr(trainer.compression, "layouts", {})  # PowerSGD's buckets
        probe, probe_agrees = predictions(trainer, job)
        return {
            "error": None, "start": trainer.start_step, "losses": losses,
            "samples": samples_taken, "diverged": diverged,
            "eval": {k: v for k, v in summary.items() if k.startswith("eval/")},
            "probe": probe, "probe_agrees": probe_agrees, "state": held_state(trainer),
            "parts": parts,
            # For the reference: the model whole (on rank 0), what this rank's replica read.
            "weights": trainer.strategy.full_state_dict(trainer.model),
            "data_rank": trainer.balance.runtime.rank,
            "stage_delays": dict(clock.stage_delays) if (clock := trainer.balance.clock) else {},
            "batches": recorder.by_step(),
            "buckets": [layouts[index][0] for index in sorted(layouts)],
        }
    finally:
        trainer.close()


def stateful_parts(trainer: Trainer) -> dict:
    """What the precision, compression and balance keep from step to step, as a copy."""
    parts = {name: getattr(trainer, name).state_dict()
             for name in ("precision", "compression", "balance")}
    return copy.deepcopy(parts)


def held_modules(trainer: Trainer) -> list[torch.nn.Module]:
    """The modules this rank holds: its pipeline stages, or the (wrapped) model."""
    pipe = getattr(trainer.strategy, "pipe", None)
    return list(pipe.modules) if pipe else [trainer.model]


def own_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def replicas_agree(trainer: Trainer) -> bool:
    """Every parameter is bitwise the same on every rank that holds it (sharded ones gathered)."""
    digests = {}
    for module in held_modules(trainer):
        for name, param in module.named_parameters():
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            raw = whole.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            digests[own_name(name)] = hashlib.sha256(raw.tobytes()).hexdigest()
    everyone = [None] * trainer.runtime.world_size
    if dist.is_initialized():
        dist.all_gather_object(everyone, digests)
    else:
        everyone = [digests]
    return all(len({d[name] for d in everyone if name in d}) == 1 for name in digests)


def probe_inputs(job: Job) -> torch.Tensor:
    """32 held-out inputs: what every rank predicts at the end."""
    _, val_set = build(job.data).splits(job.seed)
    return torch.stack([val_set[i][0] for i in range(32)])


def predictions(trainer: Trainer, job: Job) -> tuple[torch.Tensor, bool]:
    """This rank's logits for the probe inputs, and whether every rank's are bitwise the same
    (trivially so where a pipeline hands every rank the last stage's; the reference test
    checks those against the model's own forward)."""
    inputs = probe_inputs(job).to(trainer.runtime.device)
    trainer.model.eval()
    with torch.no_grad(), trainer.precision.autocast(trainer.runtime.device):
        logits = trainer.strategy.predict(trainer.model, inputs).float()
    trainer.model.train()
    if not dist.is_initialized():
        return logits.cpu(), True
    everyone = [torch.empty_like(logits) for _ in range(trainer.runtime.world_size)]
    dist.all_gather(everyone, logits)
    return logits.cpu(), all(torch.equal(everyone[0], other) for other in everyone[1:])


def local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def held_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters and optimizer state as it holds them (shards stay shards)."""
    state = {f"param/{own_name(name)}": local(p)
             for module in held_modules(trainer) for name, p in module.named_parameters()}
    # ZeRO keeps its shard inside.
    optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)
    for index, values in optimizer.state_dict()["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"optim/{index}/{key}"] = local(value)
    return state


@pytest.fixture(scope="module")
def matrix_results(request, tmp_path_factory):
    """world size → {combination: {(attempt, rank): record}}: the combinations this session
    selected, each world size's launched once."""
    tier = {"test_supported_combination_trains_and_resumes",
            "test_supported_combination_matches_its_reference"}
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.originalname in tier}
    cache: dict[int, dict] = {}

    def results(world_size: int) -> dict:
        if world_size not in cache:
            cache[world_size] = launch_cells(world_size, selected, tmp_path_factory)
        return cache[world_size]

    return results


def launch_cells(world_size: int, selected: set[str], tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"world{world_size}")
    jobs = {}
    for name in sorted(selected):
        job = make_job(cell_overrides(RUNS[name]), root / name)
        if job.launch.world_size == world_size:
            jobs[name] = job
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id="matrix",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=1,
                          start_method="forkserver", monitor_interval=0.1)
    with environment(WORKER_ENV):
        elastic_launch(config, run_cells)(jobs, str(root), 120)
    return {
        name: {(attempt, rank): torch.load(root / f"{name}.attempt{attempt}.rank{rank}.pt",
                                           weights_only=True)
               for attempt in (0, 1) for rank in range(world_size)}
        for name in jobs
    }


def composed(name: str, tmp_path_factory) -> Job:
    return make_job(cell_overrides(RUNS[name]), tmp_path_factory.mktemp("compose"))


@pytest.mark.dist
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", by_world_size())
def test_supported_combination_trains_and_resumes(name, matrix_results, tmp_path_factory):
    job = composed(name, tmp_path_factory)
    world_size, steps, checkpoint_at = (job.launch.world_size, job.train.steps,
                                        job.checkpoint.every_steps)
    records = matrix_results(world_size)[name]
    balance = RUNS[name]["balance"]
    deterministic = balance.declares("deterministic")
    for rank in range(world_size):
        first, resumed = records[0, rank], records[1, rank]
        assert first["error"] is None, first["error"]
        assert resumed["error"] is None, resumed["error"]
        # Uninterrupted run: replicas in step, loss finite, predictions agree.
        assert first["diverged"] == [] and resumed["diverged"] == []
        losses = [first["losses"][step] for step in range(1, steps + 1)]
        assert all(math.isfinite(loss) for loss in losses), losses
        assert first["probe_agrees"] and resumed["probe_agrees"]
        # Killed after the checkpoint (step 6; 4 on a schedule row), restarted: every stateful
        # part comes back as it was saved, and the run redoes the steps after it exactly.
        assert resumed["start"] == checkpoint_at
        assert_same_tree(resumed["parts"], first["parts"])
        redone = range(checkpoint_at + 1, steps + 1)
        again = [resumed["losses"][step] for step in redone]
        before = [first["losses"][step] for step in redone]
        assert first["state"].keys() == resumed["state"].keys()
        if deterministic:
            assert again == before
            assert resumed["eval"] == first["eval"]
            for key, value in first["state"].items():
                assert torch.equal(resumed["state"][key], value), key
    if RUNS[name]["strategy"].declares("pipelined"):  # the last stage waited after each compute
        delays = [records[0, rank]["stage_delays"] for rank in range(world_size)]
        assert delays[-1]["forward"] > 0 and delays[-1]["backward"] > 0, delays
        assert all(d["forward"] == d["backward"] == 0 for d in delays[:-1]), delays
    # The loss over the global batch falls (one rank's share of it is too small to tell). A
    # compression that is not exact need not lower it within these few steps (1-bit's sign
    # updates at a small lr left it flat, 6.9208 vs 6.9202 over three steps): what it computes
    # is checked against a reference applying its update rule instead.
    if RUNS[name]["compression"].declares("exact"):
        losses = [global_loss([records[0, r] for r in range(world_size)], step)
                  for step in range(1, steps + 1)]
        assert sum(losses[-3:]) < sum(losses[:3]), losses
    if not deterministic:
        assert_resumed_within_rounding(name, records, world_size, tmp_path_factory)


def assert_resumed_within_rounding(name: str, records: dict, world_size: int,
                                   tmp_path_factory) -> None:
    """Where the split follows measured step times, the resumed run may split steps 7..10
    otherwise. The first redone step starts from the checkpoint's weights: its global loss is
    the uninterrupted run's, up to rounding. After it, an exact cell's update is the global
    batch's whatever the split, but an approximate one's (onebit, PowerSGD) depends on it: the
    resumed run is held to the reference of steps 1..6 as the first run read them and 7..10
    as it read them itself, within the cell's bound (`tests.oracle.tolerance`)."""
    job = make_job(cell_overrides(RUNS[name]), tmp_path_factory.mktemp("resumed"))
    checkpoint_at = job.checkpoint.every_steps
    firsts = [records[0, rank] for rank in range(world_size)]
    bound = tolerance(job, replica_batches(firsts))
    again, before = (global_loss([records[attempt, r] for r in range(world_size)],
                                 checkpoint_at + 1) for attempt in (1, 0))
    assert abs(again - before) <= bound * abs(before), (again, before)
    resumed = replica_batches([records[1, rank] for rank in range(world_size)])
    spliced = [mine[:checkpoint_at] + later
               for mine, later in zip(replica_batches(firsts), resumed, strict=True)]
    ref = reference(job, spliced, firsts[0]["buckets"])
    error = relative_error(records[1, 0]["weights"], ref.initial, ref.final)
    assert error <= bound, f"resumed update off its reference by {error:.2e} (relative)"


def global_loss(ranks: list[dict], step: int) -> float:
    """The step's mean loss over the global batch, from each replica's mean and its samples."""
    replicas = {record["data_rank"]: record for record in ranks}.values()
    total = sum(r["losses"][step] * r["samples"][step] for r in replicas)
    return total / sum(r["samples"][step] for r in replicas)


def replica_batches(firsts: list[dict]) -> list:
    """[data-parallel rank][step][micro-batch]: what each replica read in the first run (ranks
    of one replica, its tp and pp peers, read the same)."""
    by_data_rank = {}
    for first in firsts:
        by_data_rank.setdefault(first["data_rank"], first["batches"])
    return [by_data_rank[r] for r in sorted(by_data_rank)]


@pytest.mark.dist
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", by_world_size())
def test_supported_combination_matches_its_reference(name, matrix_results, tmp_path_factory):
    """The uninterrupted run's weights after its steps against a single-process reference of
    the same math (`tests.oracle`), from the micro-batches each data-parallel rank read: the
    update may differ by rounding only, within the bound the cell's dtypes give. Rows under
    amp skip and grow the scale; rows with a straggler split unevenly."""
    world_size = composed(name, tmp_path_factory).launch.world_size
    records = matrix_results(world_size)[name]
    firsts = [records[0, rank] for rank in range(world_size)]
    assert all(first["error"] is None for first in firsts), firsts[0]["error"]
    batches = replica_batches(firsts)
    job = make_job(cell_overrides(RUNS[name]), tmp_path_factory.mktemp("reference"))
    ref = reference(job, batches, firsts[0]["buckets"])
    error = relative_error(firsts[0]["weights"], ref.initial, ref.final)
    bound = tolerance(job, batches)
    shares = sorted({tuple(sum(len(y) for _, y in rank[t]) for rank in batches)
                     for t in range(len(batches[0]))})
    assert error <= bound, (f"update off the reference by {error:.2e} (relative), bound "
                            f"{bound:.2e}; skipped steps {ref.skipped}, shares {shares}")
    if RUNS[name]["precision"].declares("loss_scaling"):  # the scale moved both ways
        assert ref.skipped and ref.growths, (ref.skipped, ref.growths)
    straggler = any(STRAGGLER in o for o in cell_overrides(RUNS[name]))
    if straggler and RUNS[name]["balance"].declares("uneven"):  # it weighed uneven shares
        assert any(len(set(share)) > 1 for share in shares), shares
    # What the run predicts (every strategy's own evaluation path: a pipeline's last stage,
    # tensor-parallel shards gathered) is what the model computes with the run's weights.
    model = initial_model(job)
    model.load_state_dict(firsts[0]["weights"])
    model.eval()
    with torch.no_grad(), autocast(build(job.precision)):
        expected = model(probe_inputs(job)).float()
    probe = firsts[0]["probe"]
    off = float((probe - expected).norm() / expected.norm())
    assert off <= bound, f"predictions off the model's own forward by {off:.2e} (relative)"


def assert_same_tree(actual, expected, path: str = "") -> None:
    """Nested dicts/lists of tensors and numbers, equal bitwise (NaN equal to NaN)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for key in expected:
            assert_same_tree(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected) or (
            actual.shape == expected.shape and actual.isnan().equal(expected.isnan())
            and torch.equal(actual.nan_to_num(), expected.nan_to_num())), path
    else:
        assert actual == expected or (actual != actual and expected != expected), path
