"""Sharded checkpoints (torch.distributed.checkpoint): save, commit atomically, find, restore.

Layout of `checkpoint.dir`:

    step_00000200/              a committed checkpoint: DCP shards, `.metadata`, `mgpu.json`
    step_00000300.partial.<id>  being written, or left by a crash while writing: never loaded

Every rank writes its shards into the `.partial` folder; when all shards and DCP's metadata are
written, rank 0 records each file's size and SHA-256 in `mgpu.json` and renames the folder to
its final name (one atomic rename). A crash before that leaves the previous checkpoint as the
newest valid one. On resume, each candidate's files are checked against `mgpu.json`: a corrupt
or truncated checkpoint is reported in one log line and skipped, never loaded.

Loading never executes pickled code: DCP's `.metadata` is read by an unpickler that admits
only DCP's own metadata classes, and non-tensor values load with `torch.load(weights_only=True)`.

What a checkpoint holds: the model (`get_model_state_dict`, so sharded strategies save their
shards) and the optimizer, both keyed by the model's own parameter names under every strategy
(a pipeline's stages too; zero1 each rank its own partition), lr scheduler, precision (grad
scaler), balance, step and data position (global sample index: valid at any world size),
under `strategy.schedule=2bw` each stage's older weight version (keyed as the model; a run
resumed from a checkpoint without one starts it as the loaded weights), and
per rank, under `rank<r>`, the compression state and the torch/numpy/python RNG states. A rank
that did not exist when the checkpoint was saved starts with fresh per-rank state.

Under another layout (the manifest records the degrees of the mesh dims, `layout_of`) a rank's
random stream is not its old rank's: ranks that share a data-parallel replica (tensor and
pipeline peers) must draw alike, and rank r of a ddp run was a replica of its own. Such a run
starts every replica on a fresh stream of its own (`Trainer.build`), the same on its ranks.

DCP loads only the keys of the template it is given, and the template comes from a fresh run:
state whose keys or shapes are only known once training ran (error-feedback residuals created
at the first step, PowerSGD memories, ssp's queue of gradients, a split over another world
size) would load as empty. Such state — the balance's and each rank's — is saved as one opaque
leaf (`pack`), which DCP writes as bytes and loads whole, whatever the template holds.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from mgpu.errors import ConfigError

if TYPE_CHECKING:
    from mgpu.job import CheckpointConf, Job
    from mgpu.runtime import Runtime
    from mgpu.trainer import Trainer

log = logging.getLogger("mgpu.checkpoint")

MANIFEST = "mgpu.json"
COMMITTED = re.compile(r"^step_(\d{8})$")


# ---- finding checkpoints (parent and rank 0) -------------------------------------------------


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def committed(root: Path) -> list[Path]:
    """Committed checkpoint folders under `root`, newest first (not yet verified)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and COMMITTED.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` must not be loaded, or None if every file is intact."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"no readable {MANIFEST} ({type(e).__name__})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, {expected['bytes']} were written"
        if sha256(file) != expected["sha256"]:
            return f"{name} does not match its SHA-256"
    return None


def newest_valid(root: Path, report: bool = True) -> Path | None:
    """The newest intact checkpoint under `root`; each broken one is reported and skipped."""
    for path in committed(root):
        reason = problem(path)
        if reason is None:
            return path
        if report:
            log.warning("checkpoint %s is corrupt or truncated (%s): skipped", path, reason)
    return None


def manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_checkpoint(job: Job) -> Job:
    """Checkpoint settings and `resume`, checked in the parent; returns the job with its paths
    made absolute.

    `resume=<path>` is replaced by the checkpoint folder it names, checked here: the run loads
    exactly that one (see `resume_source`). A run that does not resume
    from `checkpoint.dir` must not write into one that holds checkpoints: it would replace them.
    """
    cfg = job.checkpoint
    if cfg.every_steps < 0:
        raise ConfigError(f"checkpoint.every_steps={cfg.every_steps}: must be >= 0 (0 = none)")
    if cfg.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.keep_last}: must be >= 1")
    root = Path(cfg.dir).resolve()
    job = dataclasses.replace(job, checkpoint=dataclasses.replace(cfg, dir=str(root)))
    resume = str(job.resume)
    if resume == "auto":
        return job
    if resume != "none":
        path = Path(resume).resolve()
        if not COMMITTED.match(path.name):
            path = newest_valid(path) or path
        reason = problem(path)
        if reason:
            raise ConfigError(
                f"resume={resume}: not a valid checkpoint ({reason}); give another (older) "
                "step_* folder, a checkpoint.dir (its newest valid one), auto or none"
            )
        job = dataclasses.replace(job, resume=str(path))
    if committed(root) and Path(job.resume).parent != root:
        raise ConfigError(
            f"checkpoint.dir={root} holds checkpoints of an earlier run and resume={resume} "
            "would overwrite them; use resume=auto to continue that run, or another checkpoint.dir"
        )
    return job


def check_resume_shapes(job: Job, model: torch.nn.Module) -> None:
    """The model the run builds (on the meta device, as its precision stores it) against the
    checkpoint it will resume from, in the parent: DCP loads a tensor only into one of the
    same shape, so a changed model size or `precision.pad_to_multiple_of` would fail in every
    worker after launch. Every strategy and world size stores the same whole shapes."""
    source = resume_source(job.checkpoint, str(job.resume), report=False)
    if source is None:
        return
    saved = {key: tuple(meta.size) for key, meta in
             SafeReader(source).read_metadata().state_dict_metadata.items()
             if key.startswith("model.") and hasattr(meta, "size")}
    for name, tensor in model.state_dict().items():
        shape = saved.get(f"model.{name}")
        if shape is not None and shape == tuple(tensor.shape):
            continue
        held = f"holds {name} as {list(shape)}" if shape else f"holds no {name}"
        raise ConfigError(
            f"resume={source}: the checkpoint {held}, this run's model has "
            f"{list(tensor.shape)}; resume with the model and precision.pad_to_multiple_of it "
            "was saved with (any strategy and world size can resume it), or resume=none with "
            "another checkpoint.dir"
        )


def saved_keys(path: Path, prefix: str) -> list[str]:
    """The keys of the checkpoint at `path` that start with `prefix` (flattened, dotted)."""
    saved = SafeReader(path).read_metadata().state_dict_metadata
    return [key for key in saved if key.startswith(prefix)]


def restart_count() -> int:
    """How many times this invocation's worker group was restarted (0: its first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def resume_source(cfg: CheckpointConf, resume: str, report: bool = True) -> Path | None:
    """The checkpoint a (re)started run loads.

    A first attempt with `resume=<path>` loads exactly that checkpoint, even where newer ones
    exist (a roll-back). Otherwise — `resume=auto`, and every restarted worker group, which
    must go on from the run's own newest save — the newest valid one in `checkpoint.dir`, else
    the one `resume=<path>` names, else none.
    """
    named = resume not in ("auto", "none")
    if named and restart_count() == 0:
        return Path(resume)
    newest = newest_valid(Path(cfg.dir), report)
    if newest is not None:
        return newest
    return Path(resume) if named else None


def set_aside_newer(root: Path, source: Path, token: str) -> None:
    """Rolling back to `source` in `root`: the checkpoints after it belong to the abandoned
    timeline. They are moved, untouched, into one folder beside them, so that pruning cannot
    delete the resumed-from checkpoint to make room for them, `resume=auto` does not pick them
    over the resumed run's own saves, and nothing is deleted."""
    if source.parent != root or not COMMITTED.match(source.name):
        return
    newer = [p for p in committed(root) if p.name > source.name]  # step_<8 digits>: by name
    if not newer:
        return
    aside = root / f"abandoned_after_{source.name}.{token}"
    aside.mkdir()
    for path in newer:
        path.rename(aside / path.name)
    fsync_dir(root)
    log.info("resume=%s rolls back: the newer checkpoints %s were moved to %s",
             source, ", ".join(p.name for p in reversed(newer)), aside)


def resumes_switched(cfg: CheckpointConf, resume: str) -> bool:
    """Whether the checkpoint a job resumes from was saved at its run's strategy switch or
    after it (its manifest says so): the run goes on with the strategy it switched to."""
    source = resume_source(cfg, resume, report=False)
    return bool(source and manifest(source).get("switched"))


def resumed_run_id(cfg: CheckpointConf, resume: str) -> str | None:
    """The MLflow run of the checkpoint a job resumes from, so it continues that run."""
    source = resume_source(cfg, resume, report=False)  # rank 0 reports what it skips
    return manifest(source).get("run_id") if source else None


# ---- loading without executing pickled code --------------------------------------------------

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: refused")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---- what is saved ---------------------------------------------------------------------------


def numpy_rng_saved(state: tuple) -> dict[str, Any]:
    """A numpy MT19937 state (`RandomState.get_state()`) as a tensor and numbers, which load
    weights-only (numpy arrays do not)."""
    _, keys, pos, has_gauss, gauss = state
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def numpy_rng_loaded(saved: dict[str, Any]) -> tuple:
    """The state `numpy_rng_saved` took, for `RandomState.set_state`."""
    return ("MT19937", saved["keys"].numpy().astype(np.uint32), saved["pos"],
            saved["has_gauss"], saved["gauss"])


def rng_state() -> dict[str, Any]:
    """torch, numpy and python RNG states as tensors and numbers (loadable weights-only)."""
    version, internal, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": numpy_rng_saved(np.random.get_state()),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_rng_loaded(state["numpy"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def first_rank_keeps_replicas() -> DefaultSavePlanner:
    """A save planner that writes each replicated value from the lowest rank holding it.

    DCP otherwise writes a value every rank holds from whichever rank has the least to write.
    Replicas that may differ between ranks (batch-norm statistics that fsdp ranks update from
    their own batches) are then saved from a rank other than the one every rank follows (the
    first): the resumed run would evaluate with other statistics than the uninterrupted one.
    """
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def pack(tree: Any) -> bytes:
    """`tree` (tensors, numbers, strings in dicts and lists) as one opaque leaf for DCP.

    DCP writes a bytes leaf as it is and loads it whole into any template, so state whose
    keys and shapes vary loads completely. What it holds loads with `unpack`, weights-only.
    """
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    return buffer.getvalue()


def unpack(blob: bytes) -> Any:
    """What `pack` stored; tensors on the CPU (each part moves its state to its device)."""
    return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")


def train_state(trainer: Trainer, step: int, with_rank_state: bool = True) -> dict[str, Any]:
    """The run's state as one (nested) state dict for DCP; also the template to load into."""
    state = {
        "model": trainer.strategy.model_state_dict(trainer.model),
        "optim": trainer.strategy.optimizer_state_dict(trainer.model, trainer.optimizer),
        "scheduler": trainer.scheduler.state_dict(),
        "precision": trainer.precision.state_dict(),
        "balance": pack(trainer.balance.state_dict()),
        "progress": {"step": step, "data": trainer.batches.state_dict()},
    }
    pipe = trainer.strategy.pipe
    if pipe is not None and pipe.older is not None:  # PipeDream-2BW's older weight version
        state["older"] = trainer.strategy.model_state_dict(pipe.older)
    if with_rank_state:
        state[f"rank{trainer.runtime.rank}"] = pack(
            {"rng": rng_state(), "compression": trainer.compression.state_dict()}
        )
    return state


def apply_train_state(trainer: Trainer, state: dict[str, Any], with_rng: bool = True) -> int:
    """Put a loaded state dict back into the run; returns the step it was saved at. The
    rank's random states only `with_rng`: saved by the same layout."""
    trainer.strategy.load_model_state_dict(trainer.model, state["model"])
    trainer.strategy.load_optimizer_state_dict(trainer.model, trainer.optimizer, state["optim"])
    pipe = trainer.strategy.pipe
    if "older" in state:
        trainer.strategy.load_model_state_dict(pipe.older, state["older"])
    elif pipe is not None and pipe.older is not None:  # saved by a schedule without one
        pipe.restart_delay()
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.precision.load_state_dict(state["precision"])
    trainer.balance.load_state_dict(unpack(state["balance"]))
    trainer.batches.load_state_dict(state["progress"]["data"])
    own = state.get(f"rank{trainer.runtime.rank}")
    if own is not None:
        own = unpack(own)
        if with_rng:
            set_rng_state(own["rng"])
        trainer.compression.load_state_dict(own["compression"])
    return state["progress"]["step"]


def layout_of(trainer: Trainer) -> dict[str, int]:
    """The degrees of the mesh dims the run's ranks are laid out by: a rank has the same place
    (replica, tensor and pipeline coordinates) in two runs whose degrees agree."""
    plan = trainer.strategy.layout.plan
    return {"pp": plan.pp, "dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard,
            "tp": plan.tp}


# ---- the checkpointer on each rank -----------------------------------------------------------


class Checkpointer:
    """Saves on schedule (sync or async), commits on rank 0, restores at start-up."""

    def __init__(
        self, cfg: CheckpointConf, resume: str, runtime: Runtime, run_id: str | None,
        switched: bool = False,
    ) -> None:
        self.cfg, self.resume, self.runtime, self.run_id = cfg, resume, runtime, run_id
        # Whether the run's strategy switch happened (its saves resume with `switch.to`).
        self.switched = switched
        self.root = Path(cfg.dir)
        self.every, self.keep_last, self.async_save = (
            cfg.every_steps, cfg.keep_last, cfg.async_save)
        # DCP's own collectives run in a separate gloo group: an async save overlapping the
        # training collectives on the default group crashes gloo.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.token = self._shared([uuid.uuid4().hex[:8]])[0]  # names this run's partial folders
        self.pending: Future | None = None
        self.finisher = ThreadPoolExecutor(1, thread_name_prefix="mgpu-ckpt")
        self.blocked_s: list[float] = []  # how long each save held up training
        self.valid: set[str] = set()  # names of checkpoints found or made intact (rank 0)
        self.layout: dict[str, int] | None = None  # the run's layout, recorded by each commit
        self.rng_restored = False  # whether restore put the saved random states back

    def _shared(self, objects: list) -> list:
        """Rank 0's `objects` on every rank."""
        if self.group is not None:
            dist.broadcast_object_list(objects, src=0, group=self.group)
        return objects

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(
        self, trainer: Trainer, step: int,
        writer: Callable[[Path], FileSystemWriter] = FileSystemWriter,
    ) -> dict[str, float]:
        """Write the run's state at `step`; committed once every rank's shards are written.
        `writer` makes DCP's storage writer for the folder (another one injects a fault).

        Returns the time training was held up (sync: the whole save; async: staging).
        """
        started = time.perf_counter()
        self.wait()
        partial = self.root / f"{step_dir(self.root, step).name}.partial.{self.token}"
        self.layout = layout_of(trainer)
        state = train_state(trainer, step)
        if self.async_save:
            written = dcp.async_save(state, storage_writer=writer(partial),
                                     process_group=self.group,
                                     planner=first_rank_keeps_replicas())
            self.pending = self.finisher.submit(self._finish, written, partial, step)
        else:
            try:
                dcp.save(state, storage_writer=writer(partial), process_group=self.group,
                         planner=first_rank_keeps_replicas())
            except (CheckpointException, OSError) as e:
                self.skip_if_disk_full(e, partial, step)
            else:
                if self.runtime.is_main:
                    self.commit(partial, step)
        self.blocked_s.append(time.perf_counter() - started)
        return {"checkpoint/save_s": self.blocked_s[-1]}

    def summary(self) -> dict[str, float]:
        """Median time a save held up training, for the run's summary."""
        return {"checkpoint/save_s": statistics.median(self.blocked_s)} if self.blocked_s else {}

    def _finish(self, written: Future, partial: Path, step: int) -> None:
        """Background: wait for the async write (all ranks' shards), then commit on rank 0."""
        try:
            written.result()
        except (CheckpointException, OSError) as e:
            self.skip_if_disk_full(e, partial, step)
            return
        if self.runtime.is_main:
            self.commit(partial, step)

    def skip_if_disk_full(self, error: BaseException, partial: Path, step: int) -> None:
        """A save that found the disk full (or over quota) is skipped; any other error raises.

        The run goes on rather than stopping: a full disk is outside the run, the weights in
        memory are sound and the earlier checkpoints stay intact, so a stop would throw away
        every step since the last save, and a restart would find the same full disk. The
        partial folder is removed (it would fill the disk further and is never loaded), and
        one warning line per skipped save says why. DCP raises the failure on every rank, so
        all of them skip the same save; rank 0, which commits, also removes the folder.
        """
        reason = disk_full(error)
        if reason is None:
            raise error
        if self.runtime.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            log.warning("checkpoint step %d not saved, the run goes on without it: %s; its "
                        "partial folder was removed, earlier checkpoints are kept; free space "
                        "under checkpoint.dir=%s", step, reason.replace("\n", " "), self.root)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def commit(self, partial: Path, step: int) -> None:
        """Rank 0: check every rank's shard is there, record every file's size and hash, then
        rename the folder into place."""
        missing = missing_shards(partial)
        if missing:
            raise RuntimeError(
                f"checkpoint step {step} not committed: {', '.join(missing)} missing from "
                f"{partial} (written by other ranks elsewhere?); checkpoint.dir must be one "
                f"folder every node shares"
            )
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
                 for p in sorted(partial.iterdir()) if p.is_file()}
        record = {"step": step, "world_size": self.runtime.world_size, "layout": self.layout,
                  "run_id": self.run_id, "switched": self.switched, "files": files}
        try:
            write_file_durably(partial / MANIFEST, json.dumps(record, indent=1))
        except OSError as e:
            self.skip_if_disk_full(e, partial, step)
            return
        final = step_dir(self.root, step)
        if final.exists():  # a broken checkpoint that resume skipped: keep it, out of the way
            final.rename(final.with_name(f"{final.name}.skipped.{self.token}"))
        partial.rename(final)
        fsync_dir(self.root)
        self.valid.add(final.name)
        log.info("checkpoint step %d committed: %s", step, final)
        self.prune(step)

    def prune(self, newest: int) -> None:
        """Keep the newest `keep_last` valid checkpoints up to `newest` (just committed, so
        always kept); delete the older ones and partial folders older than `newest`.

        Only valid checkpoints count: a corrupt one would otherwise take the place of a valid
        one that resume needs. Checkpoints after `newest` exist only where resume skipped them
        as corrupt: they are neither counted nor deleted (saving their step sets them aside).
        """
        current = step_dir(self.root, newest)
        kept = 0
        for path in committed(self.root):
            if path.name > current.name:
                continue
            if kept >= self.keep_last:
                shutil.rmtree(path, ignore_errors=True)
            elif self.is_valid(path):
                kept += 1
        for path in self.root.glob("step_*.partial.*"):
            if int(path.name[5:13]) < newest:
                shutil.rmtree(path, ignore_errors=True)

    def is_valid(self, path: Path) -> bool:
        """Whether the checkpoint at `path` is intact; each is hashed at most once per run (the
        ones this run committed are known to be)."""
        if path.name not in self.valid:
            if problem(path) is not None:
                return False
            self.valid.add(path.name)
        return True

    def restore(self, trainer: Trainer) -> int:
        """Load the checkpoint to resume from (rank 0 picks it); returns its step, or 0."""
        found = resume_source(self.cfg, self.resume) if self.runtime.is_main else None
        if found is not None and self.resume not in ("auto", "none") and restart_count() == 0:
            set_aside_newer(self.root, found, self.token)
        [source] = self._shared([str(found) if found else None])
        if source is None:
            return 0
        saved = manifest(Path(source))
        saved_world, saved_layout = saved["world_size"], saved.get("layout")
        # A checkpoint that does not record its layout was saved by this one (or by a run
        # before layouts were recorded, which resumed only its own).
        same_layout = saved_world == self.runtime.world_size and saved_layout in (
            None, layout_of(trainer))
        state = train_state(trainer, 0, with_rank_state=self.runtime.rank < saved_world)
        if "older" in state and not saved_keys(Path(source), "older."):
            del state["older"]  # the older version starts as the loaded weights
        dcp.load(state, storage_reader=SafeReader(source), planner=WeightsOnlyLoadPlanner(),
                 process_group=self.group)
        step = apply_train_state(trainer, state, with_rng=same_layout)
        self.rng_restored = same_layout and self.runtime.rank < saved_world
        log.info("resumed from %s (step %d, saved at world size %d)", source, step, saved_world)
        if not same_layout:
            log.info("random streams: the checkpoint's layout %s is not this run's %s; each "
                     "data-parallel replica starts a fresh stream of its own", saved_layout,
                     layout_of(trainer))
        return step

    def close(self) -> None:
        """Let go of the finisher thread without waiting: on a failure its save may never end
        (a peer is gone); the normal path has waited for it already (`wait`)."""
        self.finisher.shutdown(wait=False, cancel_futures=True)


def disk_full(error: BaseException) -> str | None:
    """Why a save failed, in one line, where the disk is full (or over quota); else None.

    DCP wraps each rank's failure in one `CheckpointException` raised on every rank. A file
    DCP writes itself fails with `OSError(ENOSPC)`; a tensor shard goes through torch.save's
    zip writer, which reports the short write as a RuntimeError ("unexpected pos") instead.
    """
    if isinstance(error, OSError):
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{os.strerror(error.errno)} ({error.filename or error})"
        return None
    if isinstance(error, RuntimeError) and "unexpected pos" in str(error):
        return f"{os.strerror(errno.ENOSPC)} (a shard was written short: {error})"
    if isinstance(error, CheckpointException):
        for failure, _ in error.failures.values():
            reason = disk_full(failure)
            if reason is not None:
                return reason
    return None


def missing_shards(partial: Path) -> list[str]:
    """The files DCP's `.metadata` says the ranks wrote that are not in `partial`.

    Each rank writes its own shard files and rank 0 writes the metadata naming all of them;
    a rank whose folder is another (a node's local disk) leaves its shard out of rank 0's.
    """
    storage = SafeReader(partial).read_metadata().storage_data
    names = {info.relative_path for info in storage.values()}
    return sorted(name for name in names if not (partial / name).is_file())


def write_file_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
