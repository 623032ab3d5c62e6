"""The Python standard library's own source files as a byte-level language-modelling corpus.

Every machine that runs mgpu has it, with nothing to download: the `.py` files under
`sysconfig.get_paths()["stdlib"]` (third-party `site-packages` left out), ~30 MB of real code and
prose on CPython 3.11. Bytes are the tokens (a vocabulary of 256), so no tokenizer has to be
built or shipped. The corpus differs between interpreters: its size and the Python version are
the run's params (`run_params`).

Whole files are held out for validation, chosen by a hash of `split_seed` and each file's path:
the split is the same on every rank and in every run, whatever the run's `seed`, and a file
keeps its side when other files come or go between Python versions. A sample is a window of
`seq_len` + 1 bytes: the first `seq_len` are the input, the last `seq_len` (the same bytes
shifted by one) the targets, so each position is trained to predict the byte after it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from mgpu.errors import ConfigError

#: Folders under the stdlib that are not the standard library's own source.
SKIPPED = {"site-packages", "dist-packages", "__pycache__"}
VOCAB = 256  # bytes


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def source_files(root: Path) -> tuple[Path, ...]:
    """Every `.py` file under `root` outside SKIPPED folders, in a fixed (sorted) order."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in SKIPPED)
        found += [Path(folder, name) for name in sorted(names) if name.endswith(".py")]
    return tuple(found)


def held_out(path: Path, root: Path, val_fraction: float, split_seed: int) -> bool:
    """Whether the file is in the validation split: a fixed hash of the seed and its path."""
    key = f"{split_seed}:{path.relative_to(root).as_posix()}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") < val_fraction * 2**64


@functools.cache
def corpus(root: Path, val_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) bytes, each its files concatenated, read once per process (~0.3 s)."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path in source_files(root):
        parts[held_out(path, root, val_fraction, split_seed)].append(path.read_bytes())
    train, val = (bytearray(b"".join(parts[side])) for side in (False, True))
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8)


class TokenWindows(Dataset):
    """Sample i: bytes starts[i] .. starts[i] + seq_len as input, one further on as targets."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, starts: torch.Tensor,
                 unigram_entropy: float | None = None) -> None:
        self.tokens, self.seq_len, self.starts = tokens, seq_len, starts
        self.unigram_entropy = unigram_entropy

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[index])
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `indices` stacked, as a DataLoader would give them, in one gather of their
        windows rather than a slice and a copy per sample."""
        offsets = self.starts[indices].unsqueeze(1) + torch.arange(self.seq_len + 1)
        windows = self.tokens[offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def targets(self) -> torch.Tensor:
        """Every target byte of every sample, flat."""
        return torch.cat([self[i][1] for i in range(len(self))])

    def eval_metrics(self, loss: float) -> dict[str, float]:
        """Beside the held-out loss (nats per token): its perplexity, and the loss of the
        best model that ignores context, the training bytes' frequencies (its
        `unigram_entropy`): a model below it has learnt something from the context."""
        return {"eval/perplexity": math.exp(loss), "eval/unigram_entropy": self.unigram_entropy}


def window_starts(length: int, seq_len: int) -> torch.Tensor:
    """Starts of the non-overlapping windows of seq_len + 1 bytes in `length` bytes."""
    return torch.arange(0, length - seq_len, seq_len)


def unigram_entropy(train: torch.Tensor, targets: torch.Tensor) -> float:
    """Cross-entropy in nats per token of `targets` under the byte frequencies of `train`
    (add-one smoothed: a byte absent from training must not cost infinity)."""
    counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1
    log_p = (counts / counts.sum()).log()
    return float(-log_p[targets].mean())


class Text:
    #: Inputs are token ids, and each position's target is the token after it.
    next_token = True
    num_classes = VOCAB

    def __init__(
        self,
        batch_size: int = 16,
        seq_len: int = 64,
        val_fraction: float = 0.1,
        val_samples: int = 256,
        split_seed: int = 0,
    ) -> None:
        if not 0 < val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction}: must be between 0 and 1")
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len}: must be >= 1")
        if val_samples < 1:
            raise ConfigError(f"data.val_samples={val_samples}: must be >= 1")
        self.batch_size, self.seq_len = batch_size, seq_len
        self.val_fraction, self.val_samples, self.split_seed = val_fraction, val_samples, split_seed
        self.input_shape = (seq_len,)

    def splits(self, seed: int) -> tuple[TokenWindows, TokenWindows]:
        """(train, held-out) windows. Training takes every non-overlapping window of the
        training files; evaluation `val_samples` of the held-out files' windows, spread evenly
        over them, so an eval costs the same whatever the corpus size."""
        train, val = corpus(stdlib_root(), self.val_fraction, self.split_seed)
        every = window_starts(len(val), self.seq_len)
        if len(every) < 1:
            raise ConfigError(f"data.seq_len={self.seq_len}: longer than the held-out bytes")
        picked = torch.linspace(0, len(every) - 1, min(self.val_samples, len(every)))
        held = TokenWindows(val, self.seq_len, every[picked.round().long().unique()])
        held.unigram_entropy = unigram_entropy(train, held.targets())
        return TokenWindows(train, self.seq_len, window_starts(len(train), self.seq_len)), held

    def run_params(self) -> dict[str, str]:
        """The corpus this interpreter has, which differs between Python versions: logged as
        the run's params (file sizes only, nothing is read)."""
        root = stdlib_root()
        files = source_files(root)
        sizes = {False: 0, True: 0}
        for path in files:
            sizes[held_out(path, root, self.val_fraction, self.split_seed)] += path.stat().st_size
        return {
            "data.python_version": platform.python_version(),
            "data.corpus_root": str(root),
            "data.corpus_files": str(len(files)),
            "data.corpus_bytes": str(sizes[False] + sizes[True]),
            "data.train_bytes": str(sizes[False]),
            "data.val_bytes": str(sizes[True]),
        }
