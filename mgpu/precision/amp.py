"""float16 autocast with dynamic loss scaling (torch.amp.GradScaler).

fp16 has a narrow exponent range: small gradients underflow to zero. The loss is multiplied by
a scale before backward and the gradients divided by it before the step. A step with inf/NaN
gradients is skipped and the scale multiplied by `backoff_factor`; after `growth_interval`
clean steps in a row it is multiplied by `growth_factor`.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from mgpu.errors import ConfigError
from mgpu.precision.common import PrecisionBase, loss_seed


class AMP(PrecisionBase):
    param_dtype = torch.float16  # compute dtype of parameters (FSDP's MixedPrecisionPolicy)
    reduce_dtype = torch.float32  # gradients are reduced in fp32

    def __init__(
        self,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        pad_to_multiple_of: int = 1,
        max_nonfinite_steps: int = 20,
    ) -> None:
        super().__init__(pad_to_multiple_of, max_nonfinite_steps)
        if init_scale <= 0:
            raise ConfigError(f"precision.init_scale={init_scale}: must be > 0 (e.g. 65536.0)")
        if growth_factor <= 1:
            raise ConfigError(f"precision.growth_factor={growth_factor}: must be > 1 (e.g. 2.0)")
        if not 0 < backoff_factor < 1:
            raise ConfigError(
                f"precision.backoff_factor={backoff_factor}: must be in (0, 1) (e.g. 0.5)"
            )
        if growth_interval < 1:
            raise ConfigError(
                f"precision.growth_interval={growth_interval}: must be >= 1 (e.g. 2000)"
            )
        if not torch.cuda.is_available():
            check_cpu_support()
        self.scaler_args = dict(
            init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval,
        )
        self.scaler: torch.amp.GradScaler | None = None
        self.scale = init_scale  # after the last update; a drop means the step was skipped

    def attach(self, model: nn.Module, device: torch.device) -> None:
        super().attach(model, device)
        if self.sync_flag:
            # Ranks hold different gradients: this scaler all-reduces its inf flag.
            self.scaler = ShardedGradScaler(device.type, **self.scaler_args)
        else:
            self.scaler = torch.amp.GradScaler(device.type, **self.scaler_args)

    def autocast(self, device: torch.device) -> AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.float16)

    def backward(self, loss: torch.Tensor) -> None:
        scaled = self.scaler.scale(loss)
        scaled.backward(loss_seed(scaled))

    def grad_scale(self) -> torch.Tensor:
        return self.scaler.scale(self.one)  # the scale as a tensor, no host sync

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        self.scaler.step(optimizer)  # unscales, and skips the step on inf/NaN gradients
        self.scaler.update()
        scale = self.scaler.get_scale()
        skipped = scale < self.scale
        self.scale = scale
        self.count(skipped)
        return not skipped

    def loss_scale(self) -> float:
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.scaler.load_state_dict(state["scaler"])
        self.scale = self.scaler.get_scale()


def check_cpu_support() -> None:
    """Workers will run on CPU: the installed torch needs CPU fp16 autocast and GradScaler."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # older torch warns and disables CPU fp16 autocast
            torch.autocast("cpu", dtype=torch.float16)
            torch.amp.GradScaler("cpu")
    except (AttributeError, RuntimeError, UserWarning) as e:
        raise ConfigError(
            f"precision=amp: this torch ({torch.__version__}) has no CPU fp16 autocast or "
            f"GradScaler ({str(e).splitlines()[0]}); use precision=bf16 on CPU"
        ) from None
