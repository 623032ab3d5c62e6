"""Compression: bits packed exactly, error feedback loses nothing, bytes on the wire measured,
all ranks in step, and every option still trains."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel

from mgpu.checkpoint import SafeReader, WeightsOnlyLoadPlanner, unpack
from mgpu.compression.onebit import OneBit, decode_mean, encode, pack_signs, unpack_signs
from mgpu.job import Job
from mgpu.options import build
from mgpu.runtime import Runtime, init_runtime, shutdown
from mgpu.trainer import Trainer, one_comm_hook
from tests.conftest import QUICK, assert_refused, launch_job, make_job, mlflow_runs

OPTIONS = ("none", "fp16", "bf16", "powersgd", "onebit")


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 64, 1001])
def test_pack_unpack_round_trips_signs(numel):
    values = torch.randn(numel)
    values[::5] = 0.0  # zero counts as positive, as in the residual update
    packed = pack_signs(values)
    assert packed.dtype == torch.uint8 and packed.numel() == (numel + 7) // 8
    expected = torch.where(values >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed, numel), expected)
    other = torch.randn(numel)
    rows = unpack_signs(torch.stack([packed, pack_signs(other)]), numel)  # one row per rank
    assert torch.equal(rows, torch.stack([expected, torch.where(other >= 0, 1.0, -1.0)]))


def test_payload_decodes_to_the_value_the_sender_kept():
    """One scale per parameter, each the mean absolute value of that parameter's values."""
    compensated = torch.cat([torch.randn(1000), 100 * torch.randn(1)])  # a weight and a bias
    payload, transmitted = encode(compensated, [1000, 1])
    assert payload.numel() == 126 + 2 * 4  # ceil(1001 / 8) bytes of signs + 2 fp32 scales
    assert torch.equal(decode_mean(payload.unsqueeze(0), [1000, 1]), transmitted)
    weight, bias = transmitted.split([1000, 1])
    assert weight.abs().unique().item() == pytest.approx(compensated[:1000].abs().mean().item())
    assert bias.abs().item() == compensated[1000].abs().item()


class RecordingOneBit(OneBit):
    """OneBit that also keeps, per parameter, the sum of true gradients and of what it sent."""

    def __init__(self) -> None:
        super().__init__(warmup_steps=0)
        self.true_sum: dict[str, torch.Tensor] = {}
        self.sent_sum: dict[str, torch.Tensor] = {}

    def all_gather(self, tensor, group):
        self.own_payload = tensor.clone()
        return super().all_gather(tensor, group)

    def hook(self, group, bucket):
        names = [self.names[id(p)] for p in bucket.parameters()]
        grads = [g.clone() for g in bucket.gradients()]
        future = super().hook(group, bucket)
        sent = decode_mean(self.own_payload.unsqueeze(0), [g.numel() for g in grads])
        for name, grad, piece in zip(names, grads, sent.split([g.numel() for g in grads]),
                                     strict=True):
            self.true_sum[name] = self.true_sum.get(name, 0) + grad
            self.sent_sum[name] = self.sent_sum.get(name, 0) + piece.view_as(grad)
        return future


@pytest.mark.dist
def test_error_feedback_loses_nothing_across_steps_and_rebucketing(one_rank_group):
    """Over k steps: sum of what was sent + current residual == sum of true gradients.

    Tiny buckets make DDP re-bucket after the first step, so residuals must follow parameters.
    """
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                      nn.Linear(32, 4)),
        bucket_cap_mb=0.002,
    )
    compression = RecordingOneBit()
    model.register_comm_hook(*compression.comm_hook(model))
    layouts = train_on_random_batches(model, compression)
    assert len(layouts) > 1, "DDP did not re-bucket: the test lost its point"
    for name, true in compression.true_sum.items():
        kept = compression.sent_sum[name] + compression.residuals[name]
        torch.testing.assert_close(kept, true, rtol=0, atol=1e-5, msg=name)
    assert set(compression.state_dict()["residuals"]) == set(compression.true_sum)


def train_on_random_batches(model: nn.Module, compression: RecordingOneBit, steps: int = 8
                            ) -> set[tuple]:
    """`steps` SGD steps of `model` on random batches through `compression`'s hook; returns
    the bucket layouts DDP handed the hook (it re-buckets after its first step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    layouts = set()
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
        loss.backward()
        optimizer.step()
        compression.end_step(applied=True)
        optimizer.zero_grad()
        layouts.add(tuple(names for names, _ in compression.flat.values()))
    return layouts


@pytest.mark.dist
def test_error_feedback_loses_nothing_when_applied_steps_later(one_rank_group):
    """Under ssp (s = 2) a step's exchange is applied two steps later, and what its message
    missed becomes the residual only then: over k steps, what was sent + the residual + what
    the two exchanges in flight missed == the sum of true gradients (three interleaved
    error-feedback sequences, none of which loses anything), across DDP's re-bucketing."""
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), bucket_cap_mb=0.002)
    compression = RecordingOneBit()
    model.register_comm_hook(*compression.comm_hook(model))
    compression.applied_after(2)
    train_on_random_batches(model, compression)
    in_flight = compression.state_dict()["pending"]
    assert sorted(in_flight) == [6, 7]
    for name, true in compression.true_sum.items():
        missed = sum(new for kept in in_flight.values() for _, n, new, _ in kept if n == name)
        kept = compression.sent_sum[name] + compression.residuals[name] + missed.view_as(true)
        torch.testing.assert_close(kept, true, rtol=0, atol=1e-5, msg=name)


def error_memory_after(option: str, steps: int, overrides: list[str], tmp_path) -> torch.Tensor:
    """A one-process DDP run with `option`: its error memories after `steps` steps."""
    settings, kinds = MEMORIES[option]
    job = make_job(["strategy=ddp", "launch.nproc_per_node=1", f"compression={option}",
                    *settings, *overrides], tmp_path)
    trainer = Trainer.build(job, Runtime(0, 0, 1, 1, torch.device("cpu"), tmp_path), None)
    for _ in range(steps):
        trainer.train_step()
    memories = trainer.compression.state_dict()[kinds[0]]
    trainer.close()
    return torch.cat([m.reshape(-1) for m in memories.values()])


@pytest.mark.dist
@pytest.mark.parametrize("option", ["onebit", "powersgd"])
def test_error_memory_is_kept_in_unscaled_units_under_amp(option, one_rank_group, tmp_path):
    """Under amp the gradients arrive times the loss scale, here 1024 doubling every step; the
    error memory (compressing from step 3) is kept without it: the size fp32 training leaves
    it, not 4096-32768x that."""
    fp32 = error_memory_after(option, 6, ["precision=fp32"], tmp_path / "fp32")
    amp = error_memory_after(option, 6, ["precision=amp", "precision.init_scale=1024",
                                         "precision.growth_interval=1"], tmp_path / "amp")
    assert 0.5 < amp.norm() / fp32.norm() < 2, (amp.norm(), fp32.norm())


NONFINITE_AT = 5  # after each option's warm-up (2 steps): rank 1's gradient is made +inf
# Where each option keeps the memories a non-finite step must not reach.
MEMORIES = {
    "onebit": (["compression.warmup_steps=2"], ("residuals",)),
    "powersgd": (["compression.start_powerSGD_iter=2"], ("error", "q")),
}


@pytest.mark.dist
@pytest.mark.parametrize("option", MEMORIES)
def test_a_nonfinite_step_is_skipped_once_and_compression_memories_stay_finite(option, tmp_path):
    """One inf gradient after the warm-up: that step is skipped on both ranks, each rank's
    error-feedback memories keep their values instead of turning inf/NaN, and every later
    step applies."""
    settings, kinds = MEMORIES[option]
    summary, weights = launch_job(
        [*QUICK, "train.steps=12", f"compression={option}", *settings,
         "fault.mode=nonfinite_grad", f"fault.at_step={NONFINITE_AT}", "fault.kill_rank=1",
         "checkpoint.every_steps=12"], tmp_path)
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert log.count("optimizer step skipped") == 1, rank
        saved = saved_rank_state(tmp_path / "checkpoints" / "step_00000012", rank)
        memories = [m for kind in kinds for m in saved["compression"][kind].values()]
        assert memories and all(m.isfinite().all() for m in memories), rank
    assert math.isfinite(summary["train/loss"]) and math.isfinite(summary["eval/loss"])
    assert all(w.isfinite().all() for w in weights.values())


@pytest.mark.dist
def test_powersgd_survives_a_skipped_first_compressed_step(tmp_path):
    """Under amp a first compressed step that overflows is skipped: the memories torch created
    in it are taken back whole, and the next step starts PowerSGD afresh."""
    summary, weights = launch_job(
        [*QUICK, "train.steps=8", "compression=powersgd", "compression.start_powerSGD_iter=2",
         "fault.mode=nonfinite_grad", "fault.at_step=3", "fault.kill_rank=1",
         "checkpoint.every_steps=0"], tmp_path)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "step 3: non-finite loss or gradient" in log
    assert math.isfinite(summary["eval/loss"])
    assert all(w.isfinite().all() for w in weights.values())


@pytest.mark.dist
def test_onebit_server_residuals_reset_at_another_world_size_and_say_so(tmp_path):
    """Saved on 4 ranks (a compressed all-reduce: each rank owns a quarter of every
    parameter's server-side residual), resumed on 2: the chunks are cut otherwise, so the
    server-side residuals start at zero, in one log line; the worker-side ones carry over."""
    run = [*QUICK, "train.steps=6", "compression=onebit", "compression.warmup_steps=2",
           "checkpoint.every_steps=6"]
    launch_job([*run, "launch.nproc_per_node=4"], tmp_path / "four")
    saved = saved_rank_state(tmp_path / "four" / "checkpoints" / "step_00000006", 1)
    assert saved["compression"]["world_size"] == 4 and saved["compression"]["server"]
    resume = f"resume={tmp_path / 'four' / 'checkpoints' / 'step_00000006'}"
    launch_job([*run, "train.steps=8", "launch.nproc_per_node=2", resume], tmp_path / "two")
    log = (tmp_path / "two" / "logs" / "rank0.log").read_text()
    assert log.count("server-side residuals start at zero (saved at world size 4, now 2") == 1
    assert "compression=onebit at world size 2: all_gather" in log


@pytest.mark.dist
def test_a_wire_dtype_reaches_fsdp_reduce_scatter(tmp_path):
    """compression=bf16 under strategy=fsdp has no hook to run: FSDP2 reduce-scatters in bf16.
    The update then differs from fp32's by bf16 rounding: not bitwise the same (the dtype was
    applied), and within a few bf16 roundings of it (nothing else changed)."""
    run = [*QUICK, "train.steps=10", "strategy=fsdp", "optim=sgd", "checkpoint.every_steps=0"]
    _, fp32 = launch_job(run, tmp_path / "fp32")
    _, bf16 = launch_job([*run, "compression=bf16"], tmp_path / "bf16")
    torch.manual_seed(0)
    initial = build(make_job(run, tmp_path / "init").model, input_shape=(64,), num_classes=10)
    start = dict(initial.named_parameters())
    update = sum(float((fp32[k] - start[k]).pow(2).sum()) for k in start) ** 0.5
    off = sum(float((bf16[k] - fp32[k]).pow(2).sum()) for k in start) ** 0.5
    # Each rank's gradient, their sum and its division each rounded to bf16: 3 u relative.
    assert 0 < off <= 3 * 2.0**-8 * update, (off, update)


def saved_rank_state(path: Path, rank: int) -> dict:
    """What rank `rank` saved of its own (RNG, compression) in the checkpoint at `path`."""
    state = {f"rank{rank}": b""}
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=WeightsOnlyLoadPlanner())
    return unpack(state[f"rank{rank}"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["compression=onebit", "compression.warmup_steps=-1"],
         "compression.warmup_steps=-1: must be >= 0"),
        (["compression=powersgd", "compression.matrix_approximation_rank=0"],
         "compression.matrix_approximation_rank=0: must be >= 1"),
        (["compression=powersgd", "compression.start_powerSGD_iter=1"],
         "compression.start_powerSGD_iter=1: must be >= 2 with use_error_feedback or warm_start"),
        (["compression=powersgd", "compression.min_compression_rate=0"],
         "compression.min_compression_rate=0.0: must be > 0"),
    ],
)
def test_bad_compression_settings_are_one_config_error(overrides, message, tmp_path):
    assert_refused(overrides, message, tmp_path)


def test_no_compression_runs_with_any_strategy(tmp_path):
    job = make_job(["compression=none", "strategy=single"], tmp_path)
    assert job.launch.world_size == 1


def test_the_run_registers_at_most_one_comm_hook():
    """DDP takes one hook: none handed over leaves DDP's own all-reduce, two is a bug (the
    support rules refuse such a run before launch), never one silently replacing the other."""
    hook = (None, lambda state, bucket: None)
    assert one_comm_hook(None, None) is None
    assert one_comm_hook(None, hook) is hook
    with pytest.raises(RuntimeError, match="one comm hook"):
        one_comm_hook(hook, hook)


def train_every_option(jobs: dict[str, dict], check_from: int) -> dict[str, dict]:
    """Per rank: train each option in turn on one process group, checking after every step that
    all ranks hold identical parameters; then check that the compression's state restores."""
    runtime = init_runtime(next(iter(jobs.values())).output_dir, 120)
    try:
        return {name: train_checking_replicas(job, runtime, check_from)
                for name, job in jobs.items()}
    finally:
        shutdown()  # after every run is freed (see `shutdown`)


def train_checking_replicas(job: Job, runtime, check_from: int) -> dict:
    trainer = Trainer.build(job, runtime, None)
    mismatched_steps = []
    for step in range(1, job.train.steps + 1):
        trainer.train_step()
        if step == check_from:
            restores = replays_after_restore(trainer)
        if not identical_on_all_ranks(trainer.model):
            mismatched_steps.append(step)
    return {**trainer.evaluate(), "mismatched_steps": mismatched_steps, "restores": restores}


def identical_on_all_ranks(model: nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def replays_after_restore(trainer: Trainer) -> bool:
    """Snapshot model, optimizer, schedule and compression; 5 steps; restore; 5 steps again:
    the weights move, and the rerun is bitwise equal (not if compression state were lost)."""
    stream, batches = trainer.batches, [next(trainer.batches) for _ in range(5)]
    saved = clone_tree(trainer.model.state_dict())
    optimizer = clone_tree(trainer.optimizer.state_dict())
    scheduler = clone_tree(trainer.scheduler.state_dict())
    compression = clone_tree(trainer.compression.state_dict())
    rng = torch.get_rng_state()  # dropout

    def five_steps() -> list[torch.Tensor]:
        trainer.batches = iter(batches)
        for _ in batches:
            trainer.train_step()
        return [p.detach().clone() for p in trainer.model.parameters()]

    first = five_steps()
    moved = any(not torch.equal(a, b) for a, b in zip(first, saved.values(), strict=True))
    trainer.model.load_state_dict(saved)
    trainer.optimizer.load_state_dict(optimizer)
    trainer.scheduler.load_state_dict(scheduler)
    trainer.compression.load_state_dict(compression)
    torch.set_rng_state(rng)
    replayed = five_steps()
    trainer.batches = stream
    return moved and all(torch.equal(a, b) for a, b in zip(first, replayed, strict=True))


def clone_tree(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [clone_tree(v) for v in tree]
    return tree


def fp32_gradient_bytes(job: Job) -> int:
    """Bytes of the job's model gradients in fp32: what plain all-reduce hands over per step."""
    data = build(job.data)
    model = build(job.model, input_shape=data.input_shape, num_classes=data.num_classes)
    return 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.dist
def test_every_option_trains_in_step(tmp_path, monkeypatch):
    """strategy=ddp, 2 gloo workers, the default step budget, one launch for all options.
    (Their bytes on the wire are checked against what gloo is handed in tests/test_figures.py.)"""
    check_from = 100  # after powersgd's start_powerSGD_iter and onebit's warmup_steps (50)
    jobs = {name: make_job([f"compression={name}", "strategy=ddp", "launch.nproc_per_node=2"],
                           tmp_path / name) for name in OPTIONS}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="compression",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          start_method="spawn", monitor_interval=0.1, max_restarts=0)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as mgpu.launch does
    results = elastic_launch(config, train_every_option)(jobs, check_from)[0]

    for name, result in results.items():
        assert result["mismatched_steps"] == [], name
        assert result["eval/accuracy"] >= 0.85, (name, result["eval/accuracy"])
        assert result["restores"], name


@pytest.mark.e2e
def test_compression_sweep_logs_bytes_to_mlflow(cli, tmp_path):
    """The preset, narrowed to one job (the full sweep is 5 jobs); its metrics reach MLflow."""
    result = cli("-m", "experiment=compression_sweep", "compression=fp16", *QUICK)
    assert result.returncode == 0, result.stderr
    [child] = [r for r in mlflow_runs(tmp_path) if "mlflow.parentRunId" in r.data.tags]
    assert child.data.tags["compression"] == "fp16" and child.data.tags["strategy"] == "ddp"
    assert child.data.metrics["comm/compression_ratio"] == 2.0
    fp32 = fp32_gradient_bytes(make_job([], tmp_path / "job"))
    assert child.data.metrics["comm/bytes_per_step"] == fp32 / 2
