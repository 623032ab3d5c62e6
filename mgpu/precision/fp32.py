"""Full single precision: no autocast, no loss scaling; TF32 and cuDNN autotuning on request."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from mgpu.precision.common import PrecisionBase


class FP32(PrecisionBase):
    def __init__(
        self,
        tf32: bool = False,
        cudnn_benchmark: bool = False,
        pad_to_multiple_of: int = 1,
        max_nonfinite_steps: int = 20,
    ) -> None:
        super().__init__(pad_to_multiple_of, max_nonfinite_steps)
        self.tf32 = tf32
        self.cudnn_benchmark = cudnn_benchmark

    def attach(self, model: nn.Module, device: torch.device) -> None:
        super().attach(model, device)
        if device.type == "cuda":
            # TF32 keeps fp32 storage but rounds matmul/conv inputs to 10 mantissa bits.
            torch.set_float32_matmul_precision("high" if self.tf32 else "highest")
            torch.backends.cudnn.allow_tf32 = self.tf32
            torch.backends.cudnn.benchmark = self.cudnn_benchmark

    def autocast(self, device: torch.device) -> AbstractContextManager:
        return nullcontext()
