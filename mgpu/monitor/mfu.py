"""Model FLOPs utilisation: the model's FLOPs per sample against the GPU's dense peak.

FLOPs come from the model itself when it declares them (`flops_per_sample()`, e.g. 6·N·tokens
for a transformer), else from torch's `FlopCounterMode` over one forward and backward pass of a
copy built on the meta device (no memory, no data consumed). Peaks are dense (not 2:4 sparse)
tensor-core figures from the vendors' data sheets, in TFLOP/s. On CPU there is no MFU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)

# (substring of torch.cuda.get_device_name, {compute dtype: dense peak TFLOP/s}); first match wins
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("B200", {"bf16": 2250, "fp16": 2250, "tf32": 1100, "fp32": 80}),
    ("H200", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    ("H100 PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    ("H100", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    ("A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    ("L40S", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    ("L4", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    ("A10", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6}),
    ("V100", {"fp16": 125, "fp32": 15.7}),
]
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def peak_flops(device_name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """Dense peak FLOP/s of one GPU for `dtype`, or None for a GPU or dtype not in the table."""
    key = DTYPE_NAMES.get(dtype)
    if key == "fp32" and tf32:
        key = "tf32"
    for name, peaks in PEAK_TFLOPS:
        if name in device_name:
            return peaks[key] * 1e12 if key in peaks else None
    return None


def flops_per_sample(
    make_model: Callable[..., nn.Module], input_shape: tuple, num_classes: int
) -> float:
    """Training FLOPs (forward + backward) per sample of the model `make_model` builds."""
    with torch.device("meta"):
        model = make_model(input_shape=input_shape, num_classes=num_classes)
    if hasattr(model, "flops_per_sample"):
        return float(model.flops_per_sample())
    batch = 2
    inputs = torch.zeros(batch, *input_shape, device="meta")
    labels = torch.zeros(batch, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(inputs), labels).backward()
    return counter.get_total_flops() / batch


class MFU:
    """`train/mfu` = samples/s x FLOPs per sample / (world size x peak FLOP/s per GPU)."""

    def __init__(self, flops: float, peak: float, world_size: int) -> None:
        self.flops, self.peak, self.world_size = flops, peak, world_size

    @classmethod
    def for_run(
        cls, make_model: Callable[..., nn.Module], data, device: torch.device, precision,
        world_size: int,
    ) -> MFU | None:
        """The meter for the model `make_model` builds (`Options.model`) on `data`, or None
        (CPU, a GPU or dtype missing from the peak table)."""
        if device.type != "cuda":
            return None
        dtype = getattr(precision, "compute_dtype", precision.param_dtype)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name, dtype, tf32)
        if peak is None:
            log.warning("no dense peak for %s in %s: train/mfu not logged", name, dtype)
            return None
        flops = flops_per_sample(make_model, data.input_shape, data.num_classes)
        return cls(flops, peak, world_size)

    def __call__(self, samples_per_s: float) -> float:
        return samples_per_s * self.flops / (self.world_size * self.peak)
