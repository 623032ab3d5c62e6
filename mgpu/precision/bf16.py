"""bfloat16 autocast: matmuls and convolutions in bf16, weights and gradients in fp32.

bf16 has fp32's exponent range, so gradients do not underflow and no loss scaling is needed.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from mgpu.precision.common import PrecisionBase


class BF16(PrecisionBase):
    param_dtype = torch.bfloat16  # compute dtype of parameters (FSDP's MixedPrecisionPolicy)
    reduce_dtype = torch.float32  # gradients are reduced in fp32

    def __init__(self, pad_to_multiple_of: int = 1, max_nonfinite_steps: int = 20) -> None:
        super().__init__(pad_to_multiple_of, max_nonfinite_steps)

    def autocast(self, device: torch.device) -> AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.bfloat16)
