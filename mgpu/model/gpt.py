"""A small decoder-style transformer over images read as token sequences.

Each pixel intensity becomes a token (digits: 8x8 pixels of 0..16 → 64 tokens over a vocabulary
of 17), so the model sees a real token stream while eval accuracy stays comparable with the
MLP and CNN. Causal self-attention blocks, a final norm, mean-pooling and a classifier head.

The model states what the parallel strategies need: its blocks (FSDP units, activation
checkpointing), its tensor-parallel plan (Megatron's split: column-wise q/k/v and first MLP
layer, row-wise output projections; optionally with sequence parallelism, which also splits the
norms and the residual stream along the sequence) and where it can be cut into pipeline stages.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from mgpu.errors import ConfigError

# Activations are (batch, sequence, dim): sequence parallelism shards dim 1.
SEQ = Shard(1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads, not `heads`: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (
            f(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLPBlock(dim, dim * mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    batch_statistics = False

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        dim: int = 64,
        heads: int = 4,
        layers: int = 4,
        mlp_ratio: int = 4,
        vocab: int = 17,
    ) -> None:
        super().__init__()
        self.check_sizes(dim, heads, layers)
        self.vocab = vocab
        seq_len = math.prod(input_shape)
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        # A dict keyed "0".."N-1", not a list: pipeline stages delete the blocks they don't own
        # and the rest keep their names, so every stage's state_dict keys match the whole model.
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, mlp_ratio) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    @staticmethod
    def check_sizes(dim: int, heads: int, layers: int) -> None:
        if heads < 1 or dim % heads:
            raise ConfigError(f"model.heads={heads}: must divide model.dim={dim}")
        if layers < 1:
            raise ConfigError(f"model.layers={layers}: must be >= 1")

    @classmethod
    def check_parallel(
        cls, settings: dict, tp: int, pp: int, sequence_parallel: bool = False,
        input_shape: tuple[int, ...] = (),
    ) -> None:
        """ConfigError where `tp` ranks cannot split the heads (or, with sequence parallelism,
        the sequence of `input_shape`'s tokens) or `pp` stages the blocks."""
        heads = settings.get("heads", 4)
        hidden = settings.get("dim", 64) * settings.get("mlp_ratio", 4)
        if heads % tp or hidden % tp:
            raise ConfigError(
                f"strategy tp={tp}: must divide model.heads={heads} and the MLP hidden size "
                f"{hidden}; pick a tp degree that divides both"
            )
        tokens = math.prod(input_shape)
        if sequence_parallel and tokens % tp:
            raise ConfigError(
                f"strategy.sequence_parallel=true: tp={tp} must divide the sequence length "
                f"{tokens} (the data's input size); use sequence_parallel=false or another "
                f"tp degree"
            )
        layers = settings.get("layers", 4)
        if pp > layers:
            raise ConfigError(
                f"strategy pp={pp}: more pipeline stages than model.layers={layers}; "
                f"use pp <= {layers}"
            )

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs scaled to 0..1 (pixel intensities) as integer tokens 0..vocab-1."""
        return (x.flatten(1).clamp(0, 1) * (self.vocab - 1)).round().long()

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    @staticmethod
    def tp_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Per-block tensor-parallel plan: heads split across ranks in attention, columns then
        rows in the MLP, so each block needs one all-reduce forward and one backward.

        With `sequence_parallel` (Megatron-SP, as torchtitan plans it) the residual stream and
        the norms between those regions stay split along the sequence: each all-reduce becomes
        an all-gather before attention or the MLP and a reduce-scatter after it — the same
        traffic, but activations and norm work per rank shrink by the tp degree. The blocks
        then take and return sequence shards; `tp_sequence_bounds` converts at the ends.
        """
        if not sequence_parallel:
            return {
                "attn.q": ColwiseParallel(),
                "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc1": ColwiseParallel(),
                "mlp.fc2": RowwiseParallel(),
            }
        gather = PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),))
        return {
            "norm1": SequenceParallel(),
            "attn": gather,
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=SEQ),
            "norm2": SequenceParallel(),
            "mlp": gather,
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(output_layouts=SEQ),
        }

    @staticmethod
    def tp_sequence_bounds() -> tuple[ParallelStyle, ParallelStyle]:
        """For the first and the last of a run of sequence-parallel blocks: the replicated
        stream enters as this rank's sequence shard (a slice, no communication) and leaves
        gathered whole again for the embedding, head or next pipeline stage."""
        return (
            PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(SEQ,), use_local_output=True
            ),
            PrepareModuleOutput(output_layouts=(SEQ,), desired_output_layouts=(Replicate(),)),
        )

    def pipeline_stage(self, stage: int, stages: int) -> GPT:
        """This model cut down in place to pipeline stage `stage` of `stages`: an even share of
        the blocks; the embedding on the first stage, the norm and head on the last."""
        names = list(self.layers.keys())
        bounds = [round(i * len(names) / stages) for i in range(stages + 1)]
        keep = set(names[bounds[stage]:bounds[stage + 1]])
        for name in names:
            if name not in keep:
                del self.layers[name]
        if stage > 0:
            self.tok_emb, self.pos_emb = None, None
        if stage < stages - 1:
            self.norm, self.head = None, None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(self.tokens(x)) + self.pos_emb if self.tok_emb is not None else x
        for block in self.layers.values():
            h = block(h)
        if self.head is None:
            return h
        return self.head(self.norm(h).mean(dim=1))
