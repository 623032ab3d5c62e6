"""Composition and validation: every option builds, every experiment preset prepares, every bad
input is one clear ConfigError."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from torch.utils.data import default_collate

from mgpu import config
from mgpu.errors import ConfigError
from mgpu.job import GROUPS, Job
from mgpu.options import build
from mgpu.runtime import Runtime
from mgpu.trainer import Trainer
from tests.conftest import CONF, assert_refused, compose_config, make_job

OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_instantiates(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if group == "strategy" and option == "single":
        overrides.append("launch.nproc_per_node=auto")
    if (group, option) in (("strategy", "tp"), ("strategy", "pp"), ("strategy", "hybrid"),
                           ("data", "text")):
        overrides.append("model=gpt")  # models that can be split, or that read token sequences
    job = make_job(overrides, tmp_path)
    assert getattr(job, group)["_target_"].startswith(f"mgpu.{group}.")
    data = build(job.data)
    train_set, val_set = data.splits(job.seed)
    assert len(train_set) > len(val_set) > 0
    model = build(job.model, input_shape=data.input_shape, num_classes=data.num_classes)
    inputs, labels = default_collate([train_set[i] for i in range(4)])
    assert model(inputs).shape == (*labels.shape, data.num_classes)
    for name in ("strategy", "precision", "compression", "network", "balance", "optim"):
        assert build(getattr(job, name)) is not None


def test_auto_nproc_follows_the_strategy(tmp_path):
    assert make_job(["strategy=single"], tmp_path).launch.world_size == 1
    assert make_job(["strategy=ddp"], tmp_path).launch.world_size == 2
    assert make_job(["strategy=ddp", "launch.nproc_per_node=4"], tmp_path).launch.world_size == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+strategy.bucket_cap=3"], "strategy.bucket_cap: unknown key"),
        (["+train.foo=1"], "train.foo: Key 'foo' not in 'TrainConf'"),
        (["optim.lr=fast"], "optim.lr=fast"),
        (["model.hidden=[a]"], "model.hidden"),
        (["launch.nproc_per_node=0"], "launch.nproc_per_node=0: must be >= 1"),
        (["launch.nproc_per_node=two"], "launch.nproc_per_node=two"),
        (["launch.nnodes=3:2"], "launch.nnodes=3:2"),
        (["launch.rdzv_heartbeat_s=0"], "launch.rdzv_heartbeat_s=0: must be >= 1"),
        (["launch.rdzv_last_call_s=-1"], "launch.rdzv_last_call_s=-1: must be >= 0"),
        (["data.batch_size=63"], "data.batch_size=63: must be divisible by world size (2)"),
        (["train.grad_accum=3"], "data.batch_size=64: must be divisible"),
        (["strategy=single", "launch.nproc_per_node=2"], "strategy=single runs one process"),
        (["train.warmup_steps=-1"], "train.warmup_steps=-1: must be >= 0"),
        (["optim.lr=-1"], "optim.lr=-1.0: must be > 0"),
        (["optim.schedule=linear"], "optim.schedule=linear"),
        (["fault.mode=explode"], "fault.mode=explode"),
        (["fault.mode=exception", "fault.kill_rank=2"], "fault.kill_rank=2"),
        (["fault.schedule.count=3", "launch.max_restarts=2"],
         "fault.schedule.count=3: each fault restarts the worker group once; set "
         "launch.max_restarts >= 3"),
        (["fault.schedule.count=1", "launch.max_restarts=1", "fault.mode=sigkill"],
         "fault.schedule.count=1 with fault.mode=sigkill: use one of them"),
        (["fault.schedule.count=1", "launch.max_restarts=1", "fault.schedule.kinds=[oom]"],
         "fault.schedule.kinds=['oom']: use a list of sigkill, exception, hang"),
        (["fault.schedule.count=1", "launch.max_restarts=1", "checkpoint.every_steps=0",
          "fault.schedule.kinds=[checkpoint_sigkill]"],
         "1 checkpoint_sigkill faults need as many checkpoints, the run saves 0"),
        (["data.val_fraction=1.5"], "data.val_fraction=1.5"),
    ],
)
def test_bad_input_is_one_config_error_naming_the_key(overrides, message, tmp_path):
    assert_refused(overrides, message, tmp_path)



def test_an_elastic_node_range_checks_the_batch_at_every_world_size_it_allows(tmp_path):
    """`launch.nnodes=1:3` with 2 processes per node runs on 2, 4 or 6 ranks: 64 samples do
    not split over 6 (each rank would take 10 while the loss is divided by 64), so the job is
    refused before launch, naming both keys. A batch every size divides runs, and so does a
    balance that splits unevenly."""
    line = assert_refused(["launch.nnodes=1:3", "data.batch_size=64"], "data.batch_size=64",
                          tmp_path)
    assert "launch.nnodes=1:3" in line and "(6)" in line, line
    assert make_job(["launch.nnodes=1:3", "data.batch_size=96"], tmp_path).launch.world_size == 2
    assert make_job(["launch.nnodes=1:3", "data.batch_size=64", "balance=throughput"], tmp_path)


def test_more_processes_than_the_hosts_gpus_is_refused_before_launch(tmp_path):
    """strategy=hybrid dp=2 tp=2 starts 4 processes, one per GPU: on a 2-GPU host the fourth
    would fail in set_device(3). Refused in the parent, in one line saying what it needs and
    found, and the fix; 4 CPU processes (no GPU) and a layout that fits 2 GPUs prepare."""
    hybrid = ["strategy=hybrid", "strategy.dp=2", "strategy.tp=2", "model=gpt",
              f"output_dir={tmp_path}", "tracking.enabled=false"]
    with pytest.raises(ConfigError) as error:
        config.prepare(compose_config(hybrid), cuda_devices=2, torchrun_world=None)
    line = str(error.value)
    assert "\n" not in line
    assert "launch.nproc_per_node" in line and "4 GPUs" in line and "found 2" in line, line
    job, _ = config.prepare(compose_config(hybrid), cuda_devices=0, torchrun_world=None)
    assert job.launch.world_size == 4
    fits = [arg.replace("strategy.dp=2", "strategy.dp=1") for arg in hybrid]
    job, _ = config.prepare(compose_config(fits), cuda_devices=2, torchrun_world=None)
    assert job.launch.nproc_per_node == 2

# ---- experiment presets ----------------------------------------------------------------------

DDP, SINGLE = "mgpu.strategy.ddp.DDP", "mgpu.strategy.single.Single"
# Per preset in conf/experiment/: what every job it runs must hold (dotted keys of the prepared
# job), then what each job of its sweep holds besides, in the sweep's order ([{}]: one job).
PRESETS = {
    "dp4_tp2": (
        {"strategy._target_": "mgpu.strategy.hybrid.Hybrid", "strategy.dp": 4, "strategy.tp": 2,
         "strategy.pp": 1, "model._target_": "mgpu.model.gpt.GPT",
         "launch.nproc_per_node": 8, "launch.world_size": 8},
        [{}],
    ),
    "lr_sweep": (
        {"train.steps": 300},
        [{"strategy._target_": strategy, "launch.world_size": world_size, "optim.lr": lr}
         for strategy, world_size in ((SINGLE, 1), (DDP, 2)) for lr in (1e-3, 3e-3)],
    ),
    "gpt_gpu": (
        {"model._target_": "mgpu.model.gpt.GPT", "data._target_": "mgpu.data.text.Text",
         "precision._target_": "mgpu.precision.bf16.BF16", "model.dim": 768, "data.seq_len": 512,
         "monitor.enabled": True},
        [{}],
    ),
    "compression_sweep": (
        {"strategy._target_": DDP, "launch.world_size": 2},
        [{"compression._target_": f"mgpu.compression.{name}"}
         for name in ("none.NoCompression", "fp16.Fp16", "bf16.Bf16", "powersgd.PowerSGD",
                      "onebit.OneBit")],
    ),
}
# Presets whose jobs only a plugin makes (Optuna's distributions as params; launch keys read
# from hydra.launcher): tests/test_sweeps.py runs them through the CLI.
PLUGIN_PRESETS = {"optuna", "slurm"}
PRESET_FILES = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")
                      if p.stem not in PLUGIN_PRESETS)


def sweep_overrides(preset: str) -> list[list[str]]:
    """The overrides of each job `python -m mgpu -m experiment=<preset>` runs: the preset's
    `hydra.sweeper.params` expanded as Hydra's basic sweeper expands them (product, in order)."""
    params = compose_config([f"experiment={preset}"], hydra=True).hydra.sweeper.params or {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()]
            for o in parsed]
    return [[f"experiment={preset}", *job] for job in itertools.product(*axes)]


def dotted(job: Job, key: str):
    """`job`'s value at a dotted key: attributes of the typed sections, keys of group nodes."""
    value = job.as_dict()
    for part in key.split("."):
        value = value[part]
    return value


@pytest.mark.parametrize("preset", PRESET_FILES)
def test_every_experiment_preset_composes_and_every_job_of_it_prepares(preset, tmp_path: Path):
    """A preset no test composes breaks unseen (a renamed option, a world size that no longer
    multiplies out): each one's jobs go through `prepare` as the CLI's would, before launch."""
    assert preset in PRESETS, f"conf/experiment/{preset}.yaml: add what it sets to PRESETS"
    common, per_job = PRESETS[preset]
    jobs = [make_job(overrides, tmp_path / str(i))
            for i, overrides in enumerate(sweep_overrides(preset))]
    assert len(jobs) == len(per_job)
    for job, own in zip(jobs, per_job, strict=True):
        for key, value in {**common, **own}.items():
            assert dotted(job, key) == value, (preset, key)



@pytest.mark.dist
def test_each_process_builds_the_options_once(one_rank_group, tmp_path, monkeypatch):
    """The parent builds each group's option once to check the job (and the model once, on
    the meta device, for its own checks); a worker handed those options builds only the model
    (whose input shape the data tells), nothing twice."""
    made: Counter[str] = Counter()
    real = build

    def counting(node: dict, **runtime_args):
        made[node["_target_"]] += 1
        return real(node, **runtime_args)

    monkeypatch.setattr("mgpu.options.build", counting)
    cfg = compose_config([f"output_dir={tmp_path}", "tracking.enabled=false",
                          "launch.nproc_per_node=1", "monitor.enabled=true"])
    job, options = config.prepare(cfg, cuda_devices=0, torchrun_world=None)
    groups = [g for g in GROUPS if g != "model"]
    assert made == Counter(getattr(job, g)["_target_"] for g in [*groups, "model"])
    made.clear()
    runtime = Runtime(0, 0, 1, 1, torch.device("cpu"), tmp_path)
    Trainer.build(job, runtime, None, options).close()
    assert made == Counter([job.model["_target_"]])
