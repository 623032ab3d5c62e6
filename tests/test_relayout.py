"""Resume across layouts: a checkpoint saved under one strategy and world size resumes under
another (DCP reshards it: every key is the model's own parameter name under every layout).

Each pair is an uninterrupted run as A (8 steps, checkpoints at 4 and 8) and a run as B that
resumes A's step 4 and trains to step 8. B must load exactly what A saved (every parameter,
gathered whole, bitwise equal to the checkpoint's), start each data-parallel replica's random
stream alike on the ranks that share the replica, and end where A ended: SGD in fp32 on the
same global batch is the same math under every layout, so the final weights and losses agree
to float32 rounding (1e-5; measured <= 3e-8 on weights, 5e-7 on losses) and bitwise where the
two layouts add the same numbers in the same order (ddp <-> fsdp on two ranks).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mgpu.checkpoint import Checkpointer, SafeReader, WeightsOnlyLoadPlanner, step_dir
from mgpu.job import CheckpointConf
from mgpu.options import Options
from mgpu.runtime import Runtime
from mgpu.task.train import Train
from mgpu.trainer import Trainer
from tests.conftest import assert_refused, launch_job, make_job
from tests.test_ddp import assert_weights_close
from tests.test_text import TEXT

SAVE_AT, STEPS = 4, 8
GPT = [*TEXT, f"train.steps={STEPS}", "train.warmup_steps=2", "train.log_every=4",
       "eval.every_steps=0", f"checkpoint.every_steps={SAVE_AT}"]
# The mlp with dropout: its tensor-parallel plan gathers each block's output whole before
# the dropout, so tensor-parallel peers must draw the same masks.
MLP = ["optim=sgd", "optim.lr=0.05", f"train.steps={STEPS}", "train.warmup_steps=2",
       "train.log_every=4", "eval.every_steps=0", f"checkpoint.every_steps={SAVE_AT}",
       "model.dropout=0.1"]
TWO, FOUR = "launch.nproc_per_node=2", "launch.nproc_per_node=4"
LAYOUTS = {
    "single": ["strategy=single"],
    "ddp2": ["strategy=ddp", TWO],
    "zero1_2": ["strategy=zero1", TWO],
    "fsdp2": ["strategy=fsdp", TWO],
    "tp2": ["strategy=tp", TWO],
    "pp2": ["strategy=pp", TWO],
    "hybrid_dp2_tp2": ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", FOUR],
}
# (saved as, resumed as, bitwise): the two layouts sum the same gradients in the same order.
PAIRS = [
    ("ddp2", "fsdp2", True),
    ("fsdp2", "tp2", False),
    ("ddp2", "pp2", False),
    ("pp2", "hybrid_dp2_tp2", False),
    ("single", "ddp2", False),
    ("fsdp2", "single", False),
    ("zero1_2", "pp2", False),
]
ATOL = 1e-5


class RecordResumed(Train):
    """Trains as the default task does, and first records what the run resumed with: the whole
    model as loaded (rank 0, `resumed.pt`) and each rank's data-parallel replica and torch
    random state (`rng_rank<r>.pt`)."""

    def run(self, job, options, runtime, run_id):
        trainer = Trainer.build(job, runtime, run_id, options)
        try:
            loaded = trainer.strategy.full_state_dict(trainer.model)  # every rank gathers
            out = Path(job.output_dir)
            if runtime.is_main:
                torch.save(loaded, out / "resumed.pt")
            replica = trainer.strategy.layout.data_runtime(runtime).rank
            torch.save({"replica": replica, "rng": torch.get_rng_state()},
                       out / f"rng_rank{runtime.rank}.pt")
            summary = trainer.train()
            trainer.save_weights()
            return summary
        finally:
            trainer.close()


RECORD = "task._target_=tests.test_relayout.RecordResumed"


def saved_model(checkpoint: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole model a checkpoint holds, read by one process into tensors shaped as `like`."""
    state = {"model": {name: torch.empty_like(t) for name, t in like.items()}}
    dcp.load(state, storage_reader=SafeReader(checkpoint), planner=WeightsOnlyLoadPlanner(),
             no_dist=True)
    return state["model"]


def resume_as(base: list[str], saved: Path, layout: str, run: Path) -> tuple[dict, dict]:
    """Run `layout` from the checkpoint at `saved` (copied into its own checkpoint.dir)."""
    shutil.copytree(saved, step_dir(run / "checkpoints", SAVE_AT))
    return launch_job([*base, *LAYOUTS[layout], RECORD], run)


def assert_replicas_draw_alike(run: Path) -> None:
    """Ranks of one data-parallel replica hold the same random state; replicas differ."""
    states = [torch.load(path, weights_only=True) for path in sorted(run.glob("rng_rank*.pt"))]
    by_replica: dict[int, list[torch.Tensor]] = {}
    for state in states:
        by_replica.setdefault(state["replica"], []).append(state["rng"])
    for replica, rngs in by_replica.items():
        assert all(torch.equal(rng, rngs[0]) for rng in rngs), f"replica {replica}'s ranks differ"
    firsts = [rngs[0] for rngs in by_replica.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1:])


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(("saved_as", "resumed_as", "bitwise"), PAIRS,
                         ids=[f"{a}->{b}" for a, b, _ in PAIRS])
def test_checkpoint_resumes_under_another_layout(saved_as, resumed_as, bitwise, launched_once,
                                                 tmp_path):
    clean, clean_weights = launched_once(*GPT, *LAYOUTS[saved_as])
    saved = step_dir(launched_once.output_dir(*GPT, *LAYOUTS[saved_as]) / "checkpoints", SAVE_AT)
    summary, weights = resume_as(GPT, saved, resumed_as, tmp_path)

    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert f"resumed from {step_dir(tmp_path / 'checkpoints', SAVE_AT)} (step {SAVE_AT}," in log
    loaded = torch.load(tmp_path / "resumed.pt", weights_only=True)
    expected = saved_model(saved, clean_weights)
    assert loaded.keys() == expected.keys()
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), name
    assert_replicas_draw_alike(tmp_path)
    if bitwise:
        for name in clean_weights:
            assert torch.equal(weights[name], clean_weights[name]), name
        assert summary["train/loss"] == clean["train/loss"]
        assert summary["eval/loss"] == clean["eval/loss"]
    else:
        assert_weights_close(weights, clean_weights, atol=ATOL)
        assert summary["train/loss"] == pytest.approx(clean["train/loss"], abs=ATOL)
        assert summary["eval/loss"] == pytest.approx(clean["eval/loss"], abs=ATOL)


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tensor_parallel_peers_draw_the_same_dropout_masks_after_a_ddp_checkpoint(
    launched_once, tmp_path
):
    """Saved by ddp on two ranks (two replicas, two random streams), resumed by tp on two
    ranks (one replica): both ranks must draw one stream, not each its old rank's, or they
    drop different units of the activations they both hold whole."""
    launched_once(*MLP, *LAYOUTS["ddp2"])
    saved = step_dir(launched_once.output_dir(*MLP, *LAYOUTS["ddp2"]) / "checkpoints", SAVE_AT)
    resume_as(MLP, saved, "tp2", tmp_path)
    assert_replicas_draw_alike(tmp_path)
    assert "random streams" in (tmp_path / "logs" / "rank0.log").read_text()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_of_other_shapes_is_refused_before_launch(tmp_path):
    """DCP loads a tensor only into one of the same shape: a checkpoint of another model size,
    or stored with other padding, is refused in the parent, in one line, not by every worker."""
    root = tmp_path / "checkpoints"
    job = make_job([], tmp_path / "saved")
    model = Options.of(job.groups()).model(input_shape=(64,), num_classes=10)
    cfg = CheckpointConf(dir=str(root), every_steps=4, keep_last=1, async_save=False)
    checkpointer = Checkpointer(cfg, "auto", Runtime(0, 0, 1, 1, torch.device("cpu"), root), None)
    partial = root / f"step_00000004.partial.{checkpointer.token}"
    dcp.save({"model": model.state_dict()}, checkpoint_id=partial, no_dist=True)
    checkpointer.commit(partial, 4)
    checkpointer.close()
    for layout in LAYOUTS.values():  # any strategy and world size may resume it
        make_job([*layout, f"checkpoint.dir={root}"], tmp_path / "run")
    line = assert_refused(["precision.pad_to_multiple_of=8", f"checkpoint.dir={root}"],
                          f"resume={root / 'step_00000004'}: the checkpoint holds head.weight "
                          "as [10, 256], this run's model has [16, 256]; resume with the model "
                          "and precision.pad_to_multiple_of it was saved with", tmp_path / "run")
    assert line.endswith("or resume=none with another checkpoint.dir")
    assert_refused(["model.hidden=[128,128]", f"checkpoint.dir={root}"],
                   "holds layers.0.0.weight as [256, 64], this run's model has [128, 64]",
                   tmp_path / "run")


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("compression", ["onebit", "powersgd"])
def test_a_compression_taken_up_on_resume_starts_its_state_fresh(compression, launched_once,
                                                                 tmp_path):
    """A checkpoint saved without a stateful compression holds none of its state (residuals,
    PowerSGD's memories): resumed with one, the run starts that state as a fresh run would and
    says so, rather than every worker failing on the state it does not find."""
    launched_once(*GPT, *LAYOUTS["ddp2"])
    saved = step_dir(launched_once.output_dir(*GPT, *LAYOUTS["ddp2"]) / "checkpoints", SAVE_AT)
    shutil.copytree(saved, step_dir(tmp_path / "checkpoints", SAVE_AT))
    summary, _ = launch_job([*GPT, *LAYOUTS["ddp2"], f"compression={compression}"], tmp_path)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert f"(step {SAVE_AT}," in log
    assert f"compression={compression}: the checkpoint holds no state of it" in log
    assert summary["step"] == STEPS
