"""Full single precision: no autocast, no loss scaling."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


class FP32:
    param_dtype = torch.float32
    reduce_dtype = torch.float32

    def autocast(self, device: torch.device) -> AbstractContextManager:
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
