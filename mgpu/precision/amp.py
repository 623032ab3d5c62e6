"""float16 autocast with dynamic loss scaling.

fp16 has a narrow exponent range: small gradients underflow to zero. The loss is multiplied by
a scale before backward and the gradients divided by it before the step. A step with inf/NaN
gradients is skipped and the scale multiplied by `backoff_factor`; after `growth_interval`
clean steps in a row it is multiplied by `growth_factor`.

This is torch.amp.GradScaler's algorithm on the same fused kernels, kept here rather than in a
GradScaler: GradScaler unscales all gradients of one dtype in one fused call, which refuses a
mix of plain tensors and DTensors, and that mix is what a tensor-parallel model's gradients are
(split weights beside replicated norms and embeddings). Here every gradient is unscaled as the
shard this rank holds, by the same non-finite check the other precisions use, so one scaler
serves every strategy.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mgpu.errors import ConfigError
from mgpu.precision.common import PrecisionBase, loss_seed, nonfinite_grads


class AMP(PrecisionBase):
    param_dtype = torch.float16  # compute dtype of parameters (FSDP's MixedPrecisionPolicy)
    reduce_dtype = torch.float32  # gradients are reduced in fp32
    loss_scaling = True

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
        self.init_scale, self.growth_factor = init_scale, growth_factor
        self.backoff_factor, self.growth_interval = backoff_factor, growth_interval
        self.scale = torch.full((), init_scale)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)  # clean steps in a row

    def attach(self, model: nn.Module, device: torch.device) -> None:
        super().attach(model, device)
        self.scale = self.scale.to(device)
        self.growth_tracker = self.growth_tracker.to(device)

    def autocast(self, device: torch.device) -> AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.float16)

    def backward(self, loss: torch.Tensor) -> None:
        scaled = loss.float() * self.scale
        scaled.backward(loss_seed(scaled))

    def grad_scale(self) -> torch.Tensor:
        """The scale itself, on the device (no host sync); updated only after the step."""
        return self.scale

    def step(self, optimizer: torch.optim.Optimizer,
             grad_scale: torch.Tensor | None = None) -> bool:
        """Unscale by the scale the gradients carry (`grad_scale`, else the current one), skip
        the step if any gradient is not finite, then update the scale.

        Gradients computed some steps before (ssp) overflowed under the scale they carry: the
        scale backs off from the smaller of that and the current one, so an overflow seen late
        backs off once, not again for every step computed under the same too-large scale."""
        carried = self.scale if grad_scale is None else grad_scale
        found = nonfinite_grads(optimizer, self.device, carried.double().reciprocal().float())
        if self.sync_flag:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        skipped = bool(found.item())
        if not skipped:
            optimizer.step()
        elif grad_scale is not None:
            torch.minimum(self.scale, grad_scale, out=self.scale)
        torch._amp_update_scale_(
            self.scale, self.growth_tracker, found, self.growth_factor, self.backoff_factor,
            self.growth_interval,
        )
        self.count(skipped)
        return not skipped

    def metrics(self) -> dict[str, float]:
        """The skipped steps, and the loss scale after the last update (only amp scales)."""
        return {**super().metrics(), "amp/loss_scale": self.scale.item()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scale": self.scale.item(),
                "growth_tracker": int(self.growth_tracker.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.scale.fill_(state["scale"])
        self.growth_tracker.fill_(state["growth_tracker"])


def check_cpu_support() -> None:
    """Workers will run on CPU: the installed torch needs CPU fp16 autocast."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # older torch warns and disables CPU fp16 autocast
            torch.autocast("cpu", dtype=torch.float16)
    except (AttributeError, RuntimeError, UserWarning) as e:
        raise ConfigError(
            f"precision=amp: this torch ({torch.__version__}) has no CPU fp16 autocast "
            f"({str(e).splitlines()[0]}); use precision=bf16 on CPU"
        ) from None
