"""Tensor-core padding: Linear layers stored with sizes rounded up, computing the same function.

Tensor cores run fp16/bf16 matmuls fastest when both sizes are multiples of 8. A padded layer
keeps zeros in its extra rows and columns, pads its input with zeros and slices its output back,
so its result equals the unpadded layer's; the extra weights get zero gradients and stay zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


class PaddedLinear(nn.Module):
    """A copy of `linear` whose weight is (round_up(out), round_up(in)), zero outside the copy."""

    def __init__(self, linear: nn.Linear, multiple: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        shape = (round_up(self.out_features, multiple), round_up(self.in_features, multiple))
        with torch.no_grad():
            weight = linear.weight.new_zeros(shape)
            weight[: self.out_features, : self.in_features] = linear.weight
            self.weight = nn.Parameter(weight)
            self.bias = None
            if linear.bias is not None:
                self.bias = nn.Parameter(linear.bias.new_zeros(shape[0]))
                self.bias[: self.out_features] = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra_inputs = self.weight.shape[1] - self.in_features
        if extra_inputs:
            x = F.pad(x, (0, extra_inputs))
        return F.linear(x, self.weight, self.bias)[..., : self.out_features]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"stored={tuple(self.weight.shape)}"
        )


def pad_linear_layers(model: nn.Module, multiple: int) -> nn.Module:
    """Replace, in place, every Linear whose sizes are not multiples of `multiple`."""
    if multiple == 1:
        return model
    for name, child in model.named_children():
        aligned = isinstance(child, nn.Linear) and not (
            child.in_features % multiple or child.out_features % multiple
        )
        if isinstance(child, nn.Linear) and not aligned:
            setattr(model, name, PaddedLinear(child, multiple))
        else:
            pad_linear_layers(child, multiple)
    return model


# Module names that wrappers (DDP, torch.compile, activation checkpointing, FSDP1) insert into a
# module's path but that the full state dict, which names the model's own parameters, leaves out.
WRAPPER_NAMES = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def unpad_state_dict(
    state: dict[str, torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """`state` (the model's full state dict) with every padded layer cut back to its real sizes,
    so the saved weights load into the model built without padding."""
    for path, module in model.named_modules():
        if not isinstance(module, PaddedLinear):
            continue
        prefix = ".".join(part for part in path.split(".") if part not in WRAPPER_NAMES)
        weight, bias = f"{prefix}.weight", f"{prefix}.bias"
        if weight in state:
            state[weight] = state[weight][: module.out_features, : module.in_features]
        if bias in state:
            state[bias] = state[bias][: module.out_features]
    return state
