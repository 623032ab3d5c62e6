"""A small transformer with two readings of its input, decided by the data's shape:

- a token sequence, input shape (T,) (`data=text`): a decoder language model. Token and position
  embeddings, causal self-attention blocks, a final norm, and logits over the vocabulary at
  every position from the token embedding itself (tied weights): position t predicts token t+1.
- an image, input shape (C, H, W) (`data=digits`, `data=synthetic`): a classifier over its
  `patch` x `patch` squares, each square one token (a linear embedding of its pixels) plus a
  learned position. Attention sees the whole image, the tokens are mean-pooled into a class
  head. A pixel per token (64 tokens from a 17-level vocabulary) reached 0.68 on digits in 500
  steps; 4x4 squares reach ~0.97, as the MLP does, in a sixteenth of the sequence.

The model states what the parallel strategies need: its blocks (FSDP units, activation
checkpointing), its tensor-parallel plan (Megatron's split: column-wise q/k/v and first MLP
layer, row-wise output projections; optionally with sequence parallelism, which also splits the
norms and the residual stream along the sequence), where it can be cut into pipeline stages, and
which weight the first and the last stage share (the tied token embedding).
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
from mgpu.model import check_pipeline_blocks, keep_stage_blocks

# Activations are (batch, sequence, dim): sequence parallelism shards dim 1.
SEQ = Shard(1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.causal = causal
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads, not `heads`: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (
            f(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int, causal: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLPBlock(dim, dim * mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def sequence_length(input_shape: tuple[int, ...], patch: int) -> int:
    """Tokens per sample: the sequence itself, or an image's patch count."""
    if len(input_shape) == 1:
        return input_shape[0]
    return math.prod(size // patch for size in input_shape[1:])


class GPT(nn.Module):
    batch_statistics = False
    #: It reads token sequences and predicts the next token at every position.
    language_model = True

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        dim: int = 64,
        heads: int = 4,
        layers: int = 4,
        mlp_ratio: int = 4,
        patch: int = 4,
    ) -> None:
        super().__init__()
        self.check_sizes(dim, heads, layers, patch, input_shape)
        #: Token ids in, a prediction per position out (else an image in, a class out).
        self.next_token = len(input_shape) == 1
        self.dim, self.patch = dim, patch
        self.seq_len = sequence_length(input_shape, patch)
        if self.next_token:
            self.tok_emb = nn.Embedding(num_classes, dim)
            nn.init.normal_(self.tok_emb.weight, std=0.02)  # it is the output layer too
        else:
            self.patch_emb = nn.Linear(input_shape[0] * patch * patch, dim)
        self.pos_emb = nn.Parameter(torch.randn(self.seq_len, dim) * 0.02)
        # A dict keyed "0".."N-1", not a list: pipeline stages delete the blocks they don't own
        # and the rest keep their names, so every stage's state_dict keys match the whole model.
        self.layers = nn.ModuleDict(
            {str(i): Block(dim, heads, mlp_ratio, self.next_token) for i in range(layers)}
        )
        self.norm = nn.LayerNorm(dim)
        if not self.next_token:
            self.head = nn.Linear(dim, num_classes)

    @staticmethod
    def check_sizes(
        dim: int, heads: int, layers: int, patch: int, input_shape: tuple[int, ...]
    ) -> None:
        if len(input_shape) not in (1, 3):
            raise ConfigError(
                f"model=gpt reads token sequences (T,) or images (C, H, W), got shape "
                f"{tuple(input_shape)}"
            )
        if heads < 1 or dim % heads:
            raise ConfigError(f"model.heads={heads}: must divide model.dim={dim}")
        if layers < 1:
            raise ConfigError(f"model.layers={layers}: must be >= 1")
        images = len(input_shape) == 3
        if images and (patch < 1 or any(size % patch for size in input_shape[1:])):
            raise ConfigError(
                f"model.patch={patch}: must divide the image size {tuple(input_shape[1:])}; "
                f"use a divisor of it, e.g. model.patch=1"
            )

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
        tokens = sequence_length(input_shape, settings.get("patch", 4))
        if sequence_parallel and tokens % tp:
            raise ConfigError(
                f"strategy.sequence_parallel=true: tp={tp} must divide the sequence length "
                f"{tokens} (tokens per sample); use sequence_parallel=false or another "
                f"tp degree"
            )
        layers = settings.get("layers", 4)
        check_pipeline_blocks(pp, layers, f"model.layers={layers}")

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
        the blocks; the embeddings on the first stage, the norm and head on the last. A
        language model's last stage keeps the token embedding as its output layer: the one
        weight two stages hold (`tied_parameters`)."""
        keep_stage_blocks(self.layers, stage, stages)
        first, last = stage == 0, stage == stages - 1
        if not first:
            self.pos_emb = None
            if self.next_token and not last:
                self.tok_emb = None
            if not self.next_token:
                self.patch_emb = None
        if not last:
            self.norm = None
            if not self.next_token:
                self.head = None
        return self

    def tied_parameters(self) -> tuple[str, ...]:
        """Names of the weights that both the first and the last pipeline stage hold, whose
        gradients the two must add up: the token embedding, which is also the output layer."""
        return ("tok_emb.weight",) if self.next_token else ()

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, T), or images cut into patches, as (batch, tokens, dim)."""
        if self.next_token:
            return self.tok_emb(x) + self.pos_emb
        p = self.patch
        squares = x.unfold(2, p, p).unfold(3, p, p)  # (batch, C, H/p, W/p, p, p)
        squares = squares.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)
        return self.patch_emb(squares) + self.pos_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.pos_emb is not None else x
        for block in self.layers.values():
            h = block(h)
        if self.norm is None:
            return h
        h = self.norm(h)
        if self.next_token:
            return F.linear(h, self.tok_emb.weight)
        return self.head(h.mean(dim=1))

    def flops_per_token(self) -> float:
        """Training FLOPs (forward and backward: 3 x forward, 2 per multiply-add) per token:
        6 x the weights each token is multiplied by (blocks, output layer) plus attention's
        scores and weighted sum, 12 x layers x dim x T (nanoGPT's and PaLM's count, the causal
        mask's skipped half included). An image's patch embedding counts 4 x its weights:
        forward and weight gradient only, as the pixels it reads need no gradient."""
        blocks = [m for block in self.blocks() for m in block.modules()
                  if isinstance(m, nn.Linear)]
        per_token = 6 * sum(m.weight.numel() for m in blocks)
        per_token += 6 * self.tok_emb.weight.numel() if self.next_token else (
            4 * self.patch_emb.weight.numel())
        return per_token + 12 * len(self.layers) * self.dim * self.seq_len

    def flops_per_sample(self) -> float:
        """`flops_per_token` over the sample's tokens, and for an image its class head."""
        head = 0 if self.next_token else 6 * self.head.weight.numel()
        return self.flops_per_token() * self.seq_len + head
