"""Strategies beyond DDP on real gloo process groups, each checked against one process."""

from __future__ import annotations

import copy
import time
import types
from contextlib import contextmanager

import pytest
import torch
from torch.distributed import pipelining
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase

from mgpu.errors import ConfigError
from mgpu.model.gpt import GPT as GPTModel
from mgpu.monitor.timing import clock_for
from mgpu.options import build
from mgpu.parallel import recompute_activations
from mgpu.pipeline import SCHEDULES, Pipeline, schedule_class, stage_ids, stages_per_rank
from tests.conftest import assert_refused, launch_ranks, make_job, train_on_this_rank
from tests.test_ddp import SGD, assert_weights_close

# Whichever dist test runs first also launches the single-process reference.
pytestmark = pytest.mark.timeout(600)
# A narrow GPT keeps each launch short; 4 heads and 4 blocks still split 2 and 4 ways.
GPT = [*SGD, "model=gpt", "model.dim=32", "model.mlp_ratio=2"]
# Sharded and split computations sum in a different order than one process: float32 noise.
ATOL = 1e-5


@pytest.fixture
def launched(launched_once):
    """launched(*overrides) → (summary, weights) of model=gpt so trained, each run launched once
    per session (the single-process reference serves every parity test)."""
    return lambda *overrides: launched_once(*GPT, *overrides)


def assert_matches_single(launched, *overrides: str, steps: int | None = None) -> dict:
    """`overrides` end where strategy=single ends (after `steps`, if not the QUICK count)."""
    length = (f"train.steps={steps}",) if steps else ()
    single, single_w = launched("strategy=single", *length)
    summary, weights = launched(*overrides, *length)
    assert_weights_close(weights, single_w, atol=ATOL)
    assert summary["train/loss"] == pytest.approx(single["train/loss"], abs=ATOL)
    assert summary["eval/accuracy"] == single["eval/accuracy"]
    return summary


# HSDP: each parameter sharded over 2 ranks, those pairs replicated twice.
HSDP = ["strategy=hybrid", "strategy.dp=4", "strategy.dp_shard=2"]
PARITY = [
    ["strategy=ddp"],
    ["strategy=zero1"],
    # ZeRO-2 here; ZeRO-3 (the default) runs inside both hybrids. Checkpointing rides along.
    ["strategy=fsdp", "strategy.reshard_after_forward=false",
     "strategy.activation_checkpointing=selective"],
    ["strategy=tp", "strategy.activation_checkpointing=full"],
    ["strategy=tp", "strategy.sequence_parallel=true"],
    ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2"],
    ["strategy=hybrid", "strategy.dp=2", "strategy.pp=2"],
    HSDP,
]


@pytest.mark.dist
@pytest.mark.parametrize("overrides", PARITY, ids=[" ".join(o) for o in PARITY])
def test_strategy_matches_single_process(launched, overrides):
    """Same init and global batches: 2 ranks (4 for hybrid) end where one process ends."""
    assert_matches_single(launched, *overrides)


@pytest.mark.dist
def test_dp_tp_pp_at_once_matches_single(launched):
    """8 processes, 2 along each of dp, tp and pp; sequence parallelism rides along and meets
    the stage boundary. 10 steps: 8 processes on 2 cores take ~0.7 s a step."""
    assert_matches_single(
        launched, "strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "strategy.pp=2",
        "strategy.sequence_parallel=true", steps=10,
    )


@pytest.mark.dist
@pytest.mark.parametrize("schedule", [s for s, spec in SCHEDULES.items() if not spec.stale])
def test_every_pipeline_schedule_matches_single(launched, schedule):
    """2 ranks, 2 stages (4 for the looped and V schedules: in a V the first and the last
    stage, which share the tied embedding, both sit on rank 0), 4 micro-batches. A stale
    schedule (2bw) computes another update: tests/test_pipeline.py holds it to its own."""
    assert_matches_single(launched, "strategy=pp", f"strategy.schedule={schedule}")


@pytest.mark.dist
def test_looped_schedule_under_hybrid_matches_single(launched):
    """dp=2 x pp=2 with looped BFS: each rank's two stages, each sharded by FSDP2."""
    assert_matches_single(launched, "strategy=hybrid", "strategy.dp=2", "strategy.pp=2",
                          "strategy.schedule=looped_bfs")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_stages_sit_where_torch_schedules_expect_them(schedule, ranks):
    """Each rank builds the stages torch's own placement for the schedule gives it (looped:
    stage s on rank s % p; V: rank r holds r and 2p-1-r)."""
    per_rank = stages_per_rank(schedule)
    style = SCHEDULES[schedule].placement
    expected = generate_stage_to_rank_mapping(ranks, ranks * per_rank, style=style)
    placed = {s: r for r in range(ranks) for s in stage_ids(schedule, r, ranks)}
    assert placed == expected
    if style == "v":
        assert placed[0] == placed[2 * ranks - 1] == 0


#: What torch 2.6's torch.distributed.pipelining offers of the schedules' classes.
TORCH_2_6 = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


def test_a_schedule_this_torch_lacks_is_one_config_error():
    older = types.SimpleNamespace(**{name: getattr(pipelining, name) for name in TORCH_2_6})
    assert schedule_class("zbv", older) is pipelining.ScheduleZBVZeroBubble
    with pytest.raises(ConfigError) as error:
        schedule_class("dualpipev", older)
    assert str(error.value) == (
        "strategy.schedule=dualpipev: needs torch >= 2.9 "
        "(torch.distributed.pipelining.ScheduleDualPipeV), this is torch "
        f"{torch.__version__}; use another schedule or a newer torch")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=pp", "strategy.schedule=dualpipev", "strategy.microbatches=2"],
         "strategy.microbatches=2: strategy.schedule=dualpipev needs one per stage, 4 (2 on "
         "each of the 2 pipeline ranks); use strategy.microbatches=4 or more"),
        (["strategy=hybrid", "strategy.dp=2", "strategy.pp=2", "strategy.schedule=zbv",
          "strategy.microbatches=2"],
         "strategy.schedule=zbv: strategy=hybrid shards each stage with FSDP2, whose gradients "
         "torch's split backward (input gradients now, weight gradients later) leaves wrong "
         f"(torch {torch.__version__}, against one process); with strategy=hybrid use gpipe, "
         "1f1b, interleaved_1f1b or looped_bfs, or strategy=pp"),
        (["strategy=hybrid", "strategy.dp=2", "strategy.pp=2", "strategy.schedule=2bw",
          "strategy.microbatches=2"],
         "strategy.schedule=2bw: keeps each stage's two weight versions in plain tensors its "
         "own parameters point at, which FSDP2's sharded and tensor parallelism's DTensor "
         "parameters do not allow; use strategy=pp"),
        (["strategy=pp", "strategy.schedule=2bw", "strategy.microbatches=2",
          "train.grad_accum=2"],
         "train.grad_accum=2: strategy.schedule=2bw keeps micro-batches in flight across "
         "optimizer steps, one schedule step each; use train.grad_accum=1 and "
         "strategy.microbatches=4"),
        (["strategy=pp", "strategy.schedule=2bw", "precision=amp"],
         "precision=amp: strategy.schedule=2bw applies each step's gradients a step later, "
         "under a loss scale the scaler may have changed since; use precision=bf16 or fp32"),
        (["strategy=pp", "strategy.schedule=interleaved_zb", "strategy.microbatches=5",
          "data.batch_size=60"],
         "strategy.microbatches=5: strategy.schedule=interleaved_zb runs them in 2 rounds over "
         "the 2 pipeline ranks and needs a multiple of 2; use a multiple of 2"),
        (["strategy=pp", "strategy.schedule=interleaved_1f1b", "strategy.microbatches=9",
          "launch.nproc_per_node=4", "data.batch_size=72"],
         "strategy.microbatches=9: strategy.schedule=interleaved_1f1b runs them in 2 rounds "
         "over the 4 pipeline ranks and needs a multiple of 2; use a multiple of 4"),
        (["strategy=pp", "strategy.schedule=zbv", "model.layers=3"],
         "strategy.schedule=zbv: 2 stages on each of the 2 pipeline ranks make 4, more than "
         "model.layers=3; use a schedule of one stage per rank (gpipe, 1f1b) or at most 1 "
         "pipeline ranks"),
        (["strategy=hybrid", "strategy.pp=4", "strategy.schedule=looped_bfs",
          "model.layers=6", "launch.nproc_per_node=4"],
         "strategy.schedule=looped_bfs: 2 stages on each of the 4 pipeline ranks make 8, more "
         "than model.layers=6; use a schedule of one stage per rank (gpipe, 1f1b) or at most 3 "
         "pipeline ranks"),
    ],
    ids=["dualpipev-microbatches", "hybrid-zbv", "hybrid-2bw", "2bw-grad_accum", "2bw-amp",
         "interleaved_zb-rounds",
         "interleaved_1f1b-rounds", "zbv-blocks", "hybrid-looped_bfs-blocks"],
)
def test_a_schedule_refuses_what_it_cannot_run_in_one_exact_line(overrides, message, tmp_path):
    """Checked in the parent before launch: micro-batches against the schedule's stages or
    rounds, stages against the model's blocks; the whole line, keys and fix."""
    assert assert_refused(["model=gpt", *overrides], message, tmp_path) == message


# (start, end) perf_counter marks of this process's stage computations and training steps.
STAGE_MARKS: dict[str, list[tuple[float, float]]] = {"busy": [], "steps": []}


def marked(kind: str, method):
    """`method`, its every call marked in `STAGE_MARKS[kind]`."""

    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            STAGE_MARKS[kind].append((start, time.perf_counter()))

    return run


def marked_steps(stepping):
    """`Pipeline.stepping`, each use marked in `STAGE_MARKS["steps"]`: the schedule's step and
    the exchange of the tied weights' gradients that closes it, where the last stage waits
    for the first stage's last backward (idle time the bubble holds)."""

    @contextmanager
    def run(self):
        start = time.perf_counter()
        with stepping(self):
            yield
        STAGE_MARKS["steps"].append((start, time.perf_counter()))

    return run


def train_marking_stages(job) -> dict:
    """Per rank: the job trained with every stage's forward and backward of a micro-batch and
    the last stage's loss of each, marked by torch's own classes here, and every training
    step's span, beside the run's summary."""
    for cls, name in [(_PipelineStageBase, "forward_one_chunk"),
                      (_PipelineStageBase, "backward_one_chunk"),
                      (_PipelineSchedule, "_compute_loss")]:
        setattr(cls, name, marked("busy", getattr(cls, name)))
    Pipeline.stepping = marked_steps(Pipeline.stepping)
    summary, _ = train_on_this_rank(job)
    return {"summary": summary, **STAGE_MARKS}


def idle_share(marks: dict, first_step: int) -> float:
    """1 - (stage compute) / (schedule step time), over the steps from `first_step` (0-based)."""
    steps = marks["steps"][first_step:]
    busy = [(a, b) for a, b in marks["busy"] if a >= steps[0][0]]
    return 1 - sum(b - a for a, b in busy) / sum(b - a for a, b in steps)


@pytest.mark.dist
@pytest.mark.timing
@pytest.mark.parametrize(
    "layout",
    [["strategy=pp", "strategy.schedule=gpipe"], ["strategy=pp", "strategy.schedule=1f1b"],
     ["strategy=pp", "strategy.schedule=interleaved_1f1b"],
     ["strategy=hybrid", "strategy.dp=2", "strategy.pp=2"]],
    ids=["gpipe", "1f1b", "interleaved_1f1b", "hybrid dp=2 pp=2"])
def test_pipeline_bubble_is_the_idle_share_measured_from_stage_marks(layout, tmp_path,
                                                                     monkeypatch):
    """`pp/bubble_fraction` against the stages' own timeline: each rank's forward and backward
    computations of each micro-batch, marked on torch's classes, and each training step's span
    (the schedule's step and the tied gradients' exchange after it); the share of step time no
    stage of the rank computed, mean over ranks. Steps 4-6, the logged window. The two sets of
    marks sit microseconds apart around the same calls, a few per micro-batch, so they agree
    to well within 0.02 of the step."""
    job = make_job([*GPT, *layout, "train.steps=6", "train.warmup_steps=0",
                    "train.log_every=3", "checkpoint.every_steps=0"], tmp_path)
    ranks = job.launch.nproc_per_node
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id="bubble",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          start_method="spawn", monitor_interval=0.1, max_restarts=0)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as mgpu.launch does
    results = elastic_launch(config, train_marking_stages)(job)
    measured = sum(idle_share(results[rank], first_step=3) for rank in range(ranks)) / ranks
    logged = results[0]["summary"]["pp/bubble_fraction"]
    assert 0 < measured < 1
    assert logged == pytest.approx(measured, abs=0.02), (logged, measured)


def train_one_job(job) -> dict:
    """Per rank: the job's summary."""
    summary, _ = train_on_this_rank(job)
    return summary


@pytest.mark.dist
@pytest.mark.timing
def test_pipeline_bubble_splits_into_transfer_schedule_and_overhead(tmp_path):
    """On 2 gloo stages the bubble's three parts are shares of the step that add up to it; with
    the last stage's compute made 4 times as long (a simulated straggler), the first stage's
    wait for it is the schedule part (a peer still computing), not transfer: this model's
    activations move in microseconds. Transfer is bounded against the schedule part, not the
    step: a trip that waited for a core (another process on the host) lengthens the measured
    transfer time, once 0.057 of the step, beside 0.32 waiting on the peer."""
    parts = {}
    for name, slowdown in (("even", "[]"), ("slowed", "[1.0,4.0]")):
        job = make_job([*GPT, "strategy=pp", "strategy.schedule=1f1b", "train.steps=6",
                        "train.warmup_steps=0", "train.log_every=3", "checkpoint.every_steps=0",
                        f"straggler.slowdown={slowdown}"], tmp_path / name)
        summary = launch_ranks(train_one_job, 2, "bubble-split", job)[0]
        shares = {part: summary[f"pp/bubble_{part}_fraction"]
                  for part in ("transfer", "schedule", "overhead")}
        assert all(0 <= share <= 1 for share in shares.values()), summary
        assert sum(shares.values()) == pytest.approx(summary["pp/bubble_fraction"], abs=1e-6)
        # Each pipeline rank's own peak memory beside it (the process's resident set on CPU).
        peaks = [summary.get(f"pp/peak_bytes_rank{r}", 0) for r in (0, 1)]
        assert all(peak > 2**20 for peak in peaks) and max(peaks) <= summary["memory/peak_bytes"]
        parts[name] = shares
    slowed = parts["slowed"]
    assert slowed["schedule"] > 0.25, parts
    assert slowed["transfer"] < slowed["schedule"] / 4, parts


def one_way_times(sizes: list[int]) -> list[float]:
    """Per rank of a 2-rank pipeline group: `Pipeline.one_way_seconds` for a float32 message
    of each of `sizes` elements, rank 0 leading."""
    import torch.distributed as dist

    from mgpu.pipeline import Pipeline

    dist.init_process_group("gloo")
    try:
        pipe = types.SimpleNamespace(group=dist.group.WORLD, device=torch.device("cpu"),
                                     clock=clock_for(torch.device("cpu")))
        rank = dist.get_rank()
        return [Pipeline.one_way_seconds(pipe, torch.zeros(size), 1 - rank, rank == 0)
                for size in sizes]
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_a_messages_transfer_time_is_measured_on_the_link_and_shared():
    """The transfer part's unit, one message's one-way time, is measured over the real link:
    64 MiB take far longer than 4 bytes, and both ends of the link hold the same figure."""
    times = launch_ranks(one_way_times, 2, "one-way", [1, 16 * 2**20])
    assert times[0] == times[1]
    small, large = times[0]
    assert 0 < small and large > 10 * small, times


@pytest.mark.dist
def test_sharding_shrinks_memory_per_rank(launched):
    """FSDP: params + optimizer ≤ 1.1 × DDP's / 2; ZeRO-1: optimizer state ≈ DDP's / 2;
    HSDP on 4 ranks sharding over 2: half of DDP's, not a quarter."""
    single, ddp, zero1, fsdp, hsdp = (
        launched(*overrides)[0]
        for overrides in (["strategy=single"], ["strategy=ddp"], ["strategy=zero1"], PARITY[2],
                          HSDP)
    )
    params, optim = "memory/param_bytes_per_rank", "memory/optimizer_bytes_per_rank"
    assert ddp[params] == single[params] > 0
    assert ddp[optim] == single[optim] > 0  # SGD momentum
    assert fsdp[params] + fsdp[optim] <= 1.1 * (ddp[params] + ddp[optim]) / 2
    assert zero1[optim] == pytest.approx(ddp[optim] / 2, rel=0.1)
    assert zero1[params] == ddp[params]
    assert hsdp[params] == pytest.approx(ddp[params] / 2, rel=0.1)
    assert hsdp[optim] == pytest.approx(ddp[optim] / 2, rel=0.1)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    torch.manual_seed(0)
    model = GPTModel((1, 8, 8), 10)
    checkpointed = copy.deepcopy(model)
    recompute_activations(checkpointed, mode)
    inputs, labels = torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,))
    for m in (model, checkpointed):
        torch.nn.functional.cross_entropy(m(inputs), labels).backward()
    assert checkpointed.state_dict().keys() == model.state_dict().keys()
    for (name, p), q in zip(model.named_parameters(), checkpointed.parameters(), strict=True):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["strategy=tp", "model=gpt", "launch.nproc_per_node=3", "data.batch_size=48"],
            "strategy tp=3: must divide model.heads=4",
        ),
        (["strategy=pp", "model=gpt", "strategy.microbatches=1"],
         "strategy.microbatches=1: must be >= the 2 pipeline stages"),
        (["strategy=pp", "model=gpt", "strategy.microbatches=6"],
         "strategy.microbatches=6: must divide the batch of 64"),
        (["strategy=pp", "model=gpt", "strategy.schedule=zb"], "strategy.schedule=zb: use one of"),
        (["strategy=pp", "model=gpt", "model.layers=3", "launch.nproc_per_node=4"],
         "strategy pp=4: more pipeline stages than model.layers=3"),
        (["strategy=hybrid", "model=gpt", "strategy.dp=2", "strategy.tp=2",
          "launch.nproc_per_node=2"],
         "strategy dp=2 x tp=2 x pp=1 = 4: must equal the world size 2"),
        (["strategy=hybrid", "model=gpt", "strategy.dp=4", "strategy.dp_shard=3"],
         "strategy.dp_shard=3: must divide strategy.dp=4"),
        (["strategy=fsdp", "strategy.activation_checkpointing=some"],
         "strategy.activation_checkpointing=some: use one of none, full, selective"),
    ],
)
def test_bad_strategy_settings_are_one_config_error(overrides, message, tmp_path):
    assert_refused(overrides, message, tmp_path)


def test_sequence_parallel_needs_tp_to_divide_the_sequence(tmp_path):
    make_job(["strategy=tp", "strategy.sequence_parallel=true", "model=gpt",
              "launch.nproc_per_node=4"], tmp_path)  # digits: 4 tokens of 4x4 pixels
    expected = ("strategy.sequence_parallel=true: tp=2 must divide the sequence length 25 "
                "(tokens per sample); use sequence_parallel=false or another tp degree")
    line = assert_refused(["strategy=tp", "strategy.sequence_parallel=true", "model=gpt",
                           "data=synthetic", "data.image_size=5", "model.patch=1"], expected,
                          tmp_path)
    assert line == expected
    assert_refused(["strategy=tp", "strategy.sequence_parallel=true", "model=gpt", "data=text",
                    "data.seq_len=63"], "tp=2 must divide the sequence length 63", tmp_path)


def test_a_patch_must_divide_the_image(tmp_path):
    expected = ("model.patch=3: must divide the image size (8, 8); use a divisor of it, e.g. "
                "model.patch=1")
    assert assert_refused(["model=gpt", "model.patch=3"], expected, tmp_path) == expected


def test_only_ddp_strategies_carry_a_comm_hook(tmp_path):
    names = ("single", "ddp", "zero1", "fsdp", "tp", "pp", "hybrid")
    jobs = {name: make_job([f"strategy={name}", "model=gpt"], tmp_path) for name in names}
    carries = {n: build(j.strategy).supports_comm_hook for n, j in jobs.items()}
    assert carries == {"single": False, "ddp": True, "zero1": True, "fsdp": False, "tp": False,
                       "pp": False, "hybrid": False}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=tp", "model=mlp", "model.hidden=[256,25]"],
         "strategy tp=2: must divide every width of model.hidden=[256, 25]"),
        (["strategy=tp", "model=mlp", "strategy.sequence_parallel=true"],
         "strategy.sequence_parallel=true: model=mlp reads no sequence"),
        (["strategy=pp", "model=mlp", "model.hidden=[64]"],
         "strategy pp=2: more pipeline stages than the 1 widths of model.hidden"),
        (["strategy=tp", "model=cnn"],
         "tensor-parallel styles cover Linear and Embedding layers only"),
    ],
)
def test_mlp_and_cnn_refuse_what_their_plans_cannot_split(overrides, message, tmp_path):
    assert_refused(overrides, message, tmp_path)


@pytest.mark.parametrize("strategy", ["strategy=tp", "strategy=pp"])
def test_mlp_takes_tensor_and_pipeline_parallelism(strategy, tmp_path):
    make_job([strategy, "model=mlp"], tmp_path)


def test_zero_bubble_theory_takes_the_measured_pass_times():
    """ZB-V's bubble vanishes when forward, input-gradient and weight-gradient passes take
    equal times, ZB-H1's is interleaved 1F1B's less one weight pass per slot, and with no
    weight pass measured both are the interleaved formula (p - 1)/(v m + p - 1)."""
    def pipe(schedule: str, ranks: int, microbatches: int) -> types.SimpleNamespace:
        per_rank = stages_per_rank(schedule)
        return types.SimpleNamespace(
            size=ranks, microbatches=microbatches, stage_ids=list(range(per_rank)),
            weight_passes_in_bubble=SCHEDULES[schedule].weight_passes_in_bubble,
            theory_bubble=(ranks - 1) / (per_rank * microbatches + ranks - 1))

    theory = Pipeline.theory_at
    assert theory(pipe("zbv", 4, 8), 1.0, 1.0, 1.0) == 0
    # ZB-H1 at p = 4, v m = 16: bubble 3 (T_F + T_B - T_W) = 3 against 16 x 3 of compute.
    assert theory(pipe("interleaved_zb", 4, 8), 1.0, 1.0, 1.0) == pytest.approx(3 / (48 + 3))
    for schedule in ("zbv", "interleaved_zb"):
        assert theory(pipe(schedule, 4, 8), 2.0, 3.0, 0.0) == pytest.approx(3 / (16 + 3))
    assert theory(pipe("1f1b", 4, 8), 1.0, 1.0, 1.0) == pytest.approx(3 / (8 + 3))
