"""PowerSGD: each large gradient matrix sent as two rank-r factors (torch's `powerSGD_hook`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from mgpu.compression.commhook import CommHookCompression
from mgpu.errors import ConfigError


class PowerSGD(CommHookCompression):
    """torch's PowerSGD with its knobs; `batched_powerSGD_hook` is not used (it fails on gloo).

    Before `start_powerSGD_iter` steps, and for tensors not worth compressing (vectors, small
    matrices: see `min_compression_rate`), torch all-reduces the plain gradients.
    """

    stateful = True  # error feedback, P/Q memories and the random generator

    def __init__(
        self,
        matrix_approximation_rank: int = 2,
        start_powerSGD_iter: int = 50,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
    ) -> None:
        super().__init__()
        if matrix_approximation_rank < 1:
            raise ConfigError(
                f"compression.matrix_approximation_rank={matrix_approximation_rank}: must be >= 1"
            )
        if min_compression_rate <= 0:
            raise ConfigError(
                f"compression.min_compression_rate={min_compression_rate}: must be > 0"
            )
        first = 2 if use_error_feedback or warm_start else 1
        if start_powerSGD_iter < first:
            # DDP rebuilds its buckets after step 1; state kept per bucket must not predate it.
            raise ConfigError(
                f"compression.start_powerSGD_iter={start_powerSGD_iter}: must be >= {first}"
                + (" with use_error_feedback or warm_start" if first == 2 else "")
            )
        self.settings = dict(
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
        )
        self.state: PowerSGDState | None = None

    def hook_state(self, model: nn.Module) -> PowerSGDState:
        self.state = PowerSGDState(process_group=model.process_group, **self.settings)
        return self.state

    def hook(self, state, bucket):
        # torch tallies the elements it all-reduces for each tensor: the plain ones, or the P
        # and Q factors (exactly the sizes of its P/Q buffers); before `start_powerSGD_iter` it
        # all-reduces the whole bucket.
        tally = state.total_numel_after_compression
        plain = state.iter < state.start_powerSGD_iter
        future = powerSGD_hook(state, bucket)
        buffer = bucket.buffer()
        numel = buffer.numel() if plain else state.total_numel_after_compression - tally
        self.count_all_reduce(numel * buffer.element_size())
        return future

    def state_dict(self) -> dict:
        """Step count, random generator, and per-bucket error and P/Q buffers (keyed by index).

        Keyed by DDP bucket index, as torch keeps them: they restore exactly into a run whose
        buckets are laid out alike (same model and `network.bucket_cap_mb`).
        """
        state = self._registered()
        kind, keys, pos, has_gauss, cached = state.rng.get_state()
        return {
            "iter": state.iter,
            "rng": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "error": {i: t.clone() for i, t in state.error_dict.items()},
            "p": {i: t.clone() for i, t in state.p_memory_dict.items()},
            "q": {i: t.clone() for i, t in state.q_memory_dict.items()},
        }

    def load_state_dict(self, saved: dict) -> None:
        state = self._registered()
        rng = saved["rng"]
        state.rng.set_state(("MT19937", rng["keys"].numpy().astype("uint32"), rng["pos"],
                             rng["has_gauss"], rng["cached_gaussian"]))
        state.iter = saved["iter"]
        state.error_dict = {i: t.clone() for i, t in saved["error"].items()}
        state.p_memory_dict = {i: t.clone() for i, t in saved["p"].items()}
        state.q_memory_dict = {i: t.clone() for i, t in saved["q"].items()}

    def _registered(self) -> PowerSGDState:
        if self.state is None:
            raise RuntimeError("PowerSGD state exists once register(model) has run")
        return self.state
