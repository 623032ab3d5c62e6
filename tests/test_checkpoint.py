"""Checkpoints and resume on real gloo worker groups: exact resume, resharding, broken files."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import Dataset, TensorDataset

from mgpu.checkpoint import (
    MANIFEST,
    Checkpointer,
    SafeReader,
    check_checkpoint,
    committed,
    newest_valid,
    problem,
    step_dir,
)
from mgpu.data.loader import TrainBatches
from mgpu.errors import ConfigError
from mgpu.job import CheckpointConf
from mgpu.options import Options
from mgpu.runtime import Runtime
from tests.conftest import QUICK, assert_refused, launch_job, make_job
from tests.test_ddp import assert_weights_close
from tests.test_text import TEXT

# SGD, so that runs at different world sizes can be compared (see tests/test_ddp.py).
CKPT = [*QUICK, "optim=sgd", "optim.lr=0.05", "checkpoint.every_steps=10",
        "checkpoint.keep_last=3"]


# ---- data position: a global sample index that reshards -------------------------------------


def step_samples(world_size: int, steps: int, state: dict | None = None, accum: int = 1,
                 num_samples: int = 300, global_batch: int = 64) -> tuple[list[set], dict]:
    """The sample ids each step takes, over all ranks of `world_size`, from data `state` on."""
    ids = torch.arange(num_samples)
    dataset = TensorDataset(ids.float().unsqueeze(1), ids)
    ranks = []
    for rank in range(world_size):
        runtime = Runtime(rank, rank, world_size, world_size, torch.device("cpu"), Path("."))
        sizes = [global_batch // world_size] * world_size
        batches = TrainBatches(dataset, sizes, accum, runtime, seed=7)
        if state:
            batches.load_state_dict(state)
        ranks.append(batches)
    taken = []
    for _ in range(steps):
        step = [i for b in ranks for _ in range(accum) for i in next(b)[1].tolist()]
        assert len(step) == len(set(step)) == global_batch
        taken.append(set(step))
    assert all(b.state_dict() == ranks[0].state_dict() for b in ranks)
    return taken, ranks[0].state_dict()


def test_data_position_reshards_without_skipping_or_repeating_a_sample():
    """Saved at 4 ranks, resumed at 2, then at 1: the same samples per step as one process."""
    reference, _ = step_samples(1, 12)  # 300 samples, batch 64: 4 steps per epoch
    for epoch in range(3):
        seen = set().union(*reference[4 * epoch : 4 * epoch + 4])
        assert len(seen) == 256  # each sample of the epoch's order at most once
    first, state = step_samples(4, 6, accum=2)  # into the middle of epoch 2
    assert state == {"epoch": 1, "position": 128}
    second, state = step_samples(2, 4, state)  # across the epoch boundary
    third, _ = step_samples(1, 2, state)
    assert first + second + third == reference


class HeldPerSample(Dataset):
    """The same samples, not held in tensors: read through a DataLoader, one by one."""

    def __init__(self, data: Dataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.data[index]


def test_tensor_data_is_cut_by_index_into_the_batches_a_dataloader_gives():
    """Uneven shares, accumulation, three epochs and a resume: the direct cut of a tensor data
    set and the DataLoader over the same samples give equal batches (values and dtypes)."""
    ids = torch.arange(300)
    dataset = TensorDataset(ids.float().unsqueeze(1), ids)
    runtime = Runtime(1, 1, 2, 2, torch.device("cpu"), Path("."))
    direct = TrainBatches(dataset, [40, 24], 2, runtime, seed=3)
    loaded = TrainBatches(HeldPerSample(dataset), [40, 24], 2, runtime, seed=3)
    assert direct.loader is None and loaded.loader is not None
    for step in range(30):
        if step == 17:
            state = direct.state_dict()
            assert state == loaded.state_dict()
            direct.load_state_dict(state)
            loaded.load_state_dict(state)
        for cut, collated in zip(next(direct), next(loaded), strict=True):
            assert cut.dtype == collated.dtype
            assert torch.equal(cut, collated)


# ---- resume on real worker groups -----------------------------------------------------------


@pytest.fixture
def uninterrupted(launched_once) -> tuple[Path, dict, dict]:
    """30 steps at world size 2, checkpoints at 10, 20, 30 written in the background; launched
    once per session. Tests copy its checkpoints before they change anything."""
    overrides = [*CKPT, "checkpoint.async_save=true"]
    summary, weights = launched_once(*overrides)
    return launched_once.output_dir(*overrides) / "checkpoints", summary, weights


@pytest.mark.dist
def test_killed_rank_restarts_and_ends_bitwise_equal_to_an_uninterrupted_run(
    uninterrupted, tmp_path
):
    _, clean, clean_weights = uninterrupted
    fault = ["fault.mode=sigkill", "fault.kill_rank=1", "fault.at_step=15",
             "launch.max_restarts=1"]
    summary, weights = launch_job([*CKPT, *fault], tmp_path)
    assert list(tmp_path.glob("logs/elastic/*/attempt_1")), "the group was not restarted"
    assert "resumed from" in (tmp_path / "logs" / "rank0.log").read_text()
    for name in clean_weights:
        assert torch.equal(weights[name], clean_weights[name]), name
    assert summary["eval/loss"] == clean["eval/loss"]
    assert summary["eval/accuracy"] == clean["eval/accuracy"]


@pytest.mark.dist
def test_resume_at_world_size_one_skips_a_truncated_checkpoint(uninterrupted, tmp_path):
    """Saved at 2 ranks, resumed at 1 from step 20 (step 30's shard is cut short)."""
    saved, _, clean_weights = uninterrupted
    root = tmp_path / "checkpoints"
    for name in ("step_00000020", "step_00000030"):
        shutil.copytree(saved / name, root / name)
    shard = root / "step_00000030" / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    run = tmp_path / "run"
    _, weights = launch_job(
        [*CKPT, "launch.nproc_per_node=1", f"checkpoint.dir={root}"], run
    )
    log = (run / "logs" / "rank0.log").read_text()
    reports = [line for line in log.splitlines() if "corrupt or truncated" in line]
    assert len(reports) == 1 and "step_00000030" in reports[0] and "__1_0.distcp" in reports[0]
    assert f"resumed from {root / 'step_00000020'} (step 20, saved at world size 2)" in log
    # 10 steps at one process after 20 at two: the same weights as 30 steps at two.
    assert_weights_close(weights, clean_weights, atol=1e-5)
    assert list(root.glob("step_00000030.skipped.*")), "the broken checkpoint was not kept"


@pytest.mark.dist
def test_resume_from_an_older_step_rolls_back_and_sets_the_newer_ones_aside(
    uninterrupted, tmp_path
):
    """resume= the oldest of three checkpoints: the run goes on from that step, not from the
    newest, and ends as the uninterrupted run did. The checkpoints after it (the abandoned
    timeline) are moved, intact, into one folder that neither resume=auto nor pruning sees."""
    saved, _, clean_weights = uninterrupted
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    run = tmp_path / "run"
    _, weights = launch_job(
        [*CKPT, f"checkpoint.dir={root}", f"resume={root / 'step_00000010'}"], run
    )
    log = (run / "logs" / "rank0.log").read_text()
    assert f"resumed from {root / 'step_00000010'} (step 10, saved at world size 2)" in log
    for name in clean_weights:
        assert torch.equal(weights[name], clean_weights[name]), name
    [aside] = root.glob("abandoned_after_step_00000010.*")
    assert f"moved to {aside}" in log
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000020", "step_00000030"]
    assert all(problem(p) is None for p in aside.iterdir())
    # The resumed run saved its own 20 and 30 beside the step it resumed from.
    assert [p.name for p in committed(root)] == ["step_00000030", "step_00000020", "step_00000010"]


# A narrow GPT language model (pp needs a model cut into stages; its token embedding is also its
# output layer, held by the first and the last stage), SGD with momentum, checkpoints at 4 and 8.
LAYOUT = [*TEXT, "train.steps=8", "train.warmup_steps=2", "train.log_every=4",
          "eval.every_steps=0", "checkpoint.every_steps=4"]


@pytest.mark.dist
def test_a_pipeline_checkpoint_resumes_under_another_layout(tmp_path):
    """Saved by a 2-stage 1F1B pipeline, the checkpoint holds the model's own parameter names:
    ddp and fsdp resume its step 4 and end where the pipeline ended (the momentum buffers
    carried over too, fsdp with its own optimizer kernels), and interleaved 1F1B (4 stages,
    cut otherwise) and 2bw (whose older weight version the checkpoint lacks: it starts as the
    loaded weights) load its step 8 exactly."""
    _, piped = launch_job([*LAYOUT, "strategy=pp"], tmp_path / "pp")
    saved = tmp_path / "pp" / "checkpoints"
    resumed = {"ddp": (["strategy=ddp"], 4), "fsdp": (["strategy=fsdp"], 4),
               "interleaved": (["strategy=pp", "strategy.schedule=interleaved_1f1b"], 8),
               "2bw": (["strategy=pp", "strategy.schedule=2bw"], 8)}
    for name, (strategy, step) in resumed.items():
        run = tmp_path / name
        root = run / "checkpoints"
        shutil.copytree(step_dir(saved, step), step_dir(root, step))
        _, weights = launch_job([*LAYOUT, *strategy], run)
        log = (run / "logs" / "rank0.log").read_text()
        assert f"resumed from {step_dir(root, step)} (step {step}," in log
        if step == 8:  # nothing left to train: the weights as loaded
            for key in piped:
                assert torch.equal(weights[key], piped[key]), key
        else:
            assert_weights_close(weights, piped, atol=1e-5)

# ---- which checkpoint is picked: the manifest, without a process group ----------------------


def commit_checkpoints(root: Path, steps: list[int], keep_last: int = 0) -> None:
    """Checkpoints at `steps` under `root` as a run commits them: DCP writes the shards and
    `.metadata` into a partial folder (here one process's save), then rank 0's commit records
    each file's size and SHA-256 in the manifest and renames the folder into place. Picking
    and refusing read only those files, so no process group is needed to test them."""
    cfg = CheckpointConf(dir=str(root), every_steps=10, keep_last=keep_last or len(steps),
                         async_save=False)
    checkpointer = Checkpointer(cfg, "auto", Runtime(0, 0, 1, 1, torch.device("cpu"), root), None)
    for step in steps:
        partial = root / f"{step_dir(root, step).name}.partial.{checkpointer.token}"
        dcp.save({"weight": torch.full((64,), float(step))}, checkpoint_id=partial, no_dist=True)
        checkpointer.commit(partial, step)
    checkpointer.close()


# One process writes the shards here on purpose: DCP says it assumes so.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_uncommitted_and_corrupt_checkpoints_are_never_picked(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    commit_checkpoints(root, [10, 20, 30])
    assert newest_valid(root) == root / "step_00000030"
    # Killed after every shard was written, before the commit: no manifest, partial name.
    (root / "step_00000030" / MANIFEST).unlink()
    (root / "step_00000030").rename(root / "step_00000030.partial.dead")
    # One flipped byte, size unchanged.
    metadata = root / "step_00000020" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[-1] ^= 0xFF
    metadata.write_bytes(bytes(data))
    caplog.clear()  # DCP's own debug records from writing them
    with caplog.at_level(logging.WARNING, logger="mgpu.checkpoint"):
        assert newest_valid(root) == root / "step_00000010"
    [report] = caplog.messages
    assert "step_00000020" in report and ".metadata does not match its SHA-256" in report
    job = make_job(["resume=none"], tmp_path / "a")
    job = dataclasses.replace(job, resume=str(root / "step_00000020"))
    with pytest.raises(ConfigError, match=r"^resume=\S+step_00000020: not a valid checkpoint "
                       r"\(.metadata does not match its SHA-256\); give another \(older\) "
                       r"step_\* folder, [^\n]*$"):
        check_checkpoint(job)
    # A shard cut short: the size alone gives it away, before any hashing.
    shard = root / "step_00000010" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    assert problem(root / "step_00000010") == (
        f"__0_0.distcp has {size // 2} bytes, {size} were written")
    assert newest_valid(root, report=False) is None


def truncate_shard(checkpoint: Path) -> None:
    shard = checkpoint / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pruning_counts_only_valid_checkpoints_and_keeps_the_one_just_committed(tmp_path):
    root = tmp_path / "checkpoints"
    # A corrupt newer checkpoint (resume skipped it): with keep_last=1 the run's own step 25
    # is the one to keep; the corrupt 30 is kept for inspection, not counted.
    commit_checkpoints(root, [10, 20, 30])
    truncate_shard(root / "step_00000030")
    commit_checkpoints(root, [25], keep_last=1)
    assert [p.name for p in committed(root)] == ["step_00000030", "step_00000025"]
    assert problem(root / "step_00000025") is None
    # A corrupt older checkpoint does not count towards keep_last=2: the valid 10 stays.
    shutil.rmtree(root)
    commit_checkpoints(root, [10, 20])
    truncate_shard(root / "step_00000020")
    commit_checkpoints(root, [30], keep_last=2)
    assert newest_valid(root, report=False) == root / "step_00000030"
    assert [p.name for p in committed(root)] == ["step_00000030", "step_00000020", "step_00000010"]
    assert problem(root / "step_00000010") is None


def test_run_without_resume_refuses_a_checkpoint_dir_it_would_overwrite(tmp_path):
    (tmp_path / "checkpoints" / "step_00000010").mkdir(parents=True)
    assert_refused(["resume=none"], "resume=none would overwrite them", tmp_path)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_checkpoint_metadata_that_would_run_code_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system: refused"):
        SafeReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "pwned").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_commit_refuses_a_checkpoint_missing_a_rank_s_shard(tmp_path):
    """A rank whose `checkpoint.dir` is another folder (a node that does not share the
    filesystem) writes its shard elsewhere: DCP's `.metadata` still names it, and rank 0 must
    not commit a checkpoint without it."""
    root = tmp_path / "checkpoints"
    cfg = CheckpointConf(dir=str(root), every_steps=10, keep_last=2, async_save=False)
    checkpointer = Checkpointer(cfg, "auto", Runtime(0, 0, 2, 1, torch.device("cpu"), root), None)
    partial = root / f"step_00000010.partial.{checkpointer.token}"
    dcp.save({"weight": torch.ones(64)}, checkpoint_id=partial, no_dist=True)
    (partial / "__0_0.distcp").rename(tmp_path / "__0_0.distcp")  # written on another node
    with pytest.raises(RuntimeError, match=r"__0_0\.distcp missing.*every node shares"):
        checkpointer.commit(partial, 10)
    checkpointer.close()
    assert committed(root) == [] and partial.is_dir()


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size (bytes) mounted under `tmp_path`, unmounted afterwards; skipped
    where this process may not mount one."""
    mounted = []

    def mount(size: int) -> Path:
        path = tmp_path / "disk"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.dist
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_save_that_fills_the_disk_is_skipped_and_the_run_goes_on(
    async_save, uninterrupted, small_disk, tmp_path
):
    """checkpoint.dir on a tmpfs with room for one checkpoint and a half: step 10 commits,
    steps 20 and 30 run out of space while writing (a real ENOSPC from the filesystem). Each
    is skipped with one warning and its partial folder removed; step 10 stays intact and the
    run trains to its end, whether the save is written in the background or not."""
    saved, _, _ = uninterrupted
    one = sum(p.stat().st_size for p in (saved / "step_00000010").iterdir())
    root = small_disk(one * 3 // 2) / "checkpoints"
    run = tmp_path / "run"
    summary, _ = launch_job([*CKPT, "checkpoint.keep_last=1", f"checkpoint.async_save={async_save}",
                             f"checkpoint.dir={root}"], run)
    assert summary["step"] == 30
    log = (run / "logs" / "rank0.log").read_text()
    skipped = [line for line in log.splitlines() if "not saved" in line]
    assert len(skipped) == 2, log
    for line, step in zip(skipped, (20, 30), strict=True):
        expected = f"checkpoint step {step} not saved, the run goes on without it: No space"
        assert expected in line, line
        assert "its partial folder was removed, earlier checkpoints are kept" in line
    assert [p.name for p in root.iterdir()] == ["step_00000010"]
    assert problem(root / "step_00000010") is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_missing_metadata_file_is_skipped_by_auto_and_refused_by_name(tmp_path, caplog):
    """DCP's `.metadata` gone from the newest checkpoint: resume=auto takes the one before it
    and says why in one line; resume=<that folder> is one error naming the file; nothing is
    deleted."""
    root = tmp_path / "checkpoints"
    commit_checkpoints(root, [10, 20])
    (root / "step_00000020" / ".metadata").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mgpu.checkpoint"):
        assert newest_valid(root) == root / "step_00000010"
    assert caplog.messages == [f"checkpoint {root / 'step_00000020'} is corrupt or truncated "
                               "(.metadata is missing): skipped"]
    job = make_job(["resume=none"], tmp_path / "a")
    job = dataclasses.replace(job, resume=str(root / "step_00000020"))
    with pytest.raises(ConfigError, match=r"^resume=\S+step_00000020: not a valid checkpoint "
                       r"\(.metadata is missing\); give another \(older\) step_\* folder, "):
        check_checkpoint(job)
    assert [p.name for p in committed(root)] == ["step_00000020", "step_00000010"]
    assert problem(root / "step_00000010") is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_of_another_model_named_by_path_is_refused_and_left_as_it_was(tmp_path):
    """resume=<an older step> of a checkpoint.dir saved with hidden 256, by a run with hidden
    128: one line in the parent naming the folder, the key and both shapes; the newer
    checkpoint is not set aside (no roll-back starts) and no file changes."""
    root = tmp_path / "checkpoints"
    model = Options.of(make_job([], tmp_path / "saved").groups()).model(
        input_shape=(64,), num_classes=10)
    cfg = CheckpointConf(dir=str(root), every_steps=4, keep_last=2, async_save=False)
    checkpointer = Checkpointer(cfg, "auto", Runtime(0, 0, 1, 1, torch.device("cpu"), root), None)
    for step in (4, 8):
        partial = root / f"step_{step:08d}.partial.{checkpointer.token}"
        dcp.save({"model": model.state_dict()}, checkpoint_id=partial, no_dist=True)
        checkpointer.commit(partial, step)
    checkpointer.close()
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    named = step_dir(root, 4)
    line = assert_refused(["model.hidden=[128,128]", f"checkpoint.dir={root}", f"resume={named}"],
                          "", tmp_path / "run")
    assert line.startswith(f"resume={named}: the checkpoint holds layers.0.0.weight as "
                           "[256, 64], this run's model has [128, 64]; "), line
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "run" / "logs").exists()  # no worker started
