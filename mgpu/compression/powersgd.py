"""PowerSGD: each large gradient matrix sent as two rank-r factors (torch's `powerSGD_hook`).

torch keeps PowerSGD's memories per DDP bucket index: the error-feedback vector (the bucket's
values end to end) and the warm-start Q factors (one per compressed matrix). DDP lays out its
buckets anew after the first step of every run: a resumed run's first step has the initial
layout (one bucket of every parameter in model order), the run it continues had the rebuilt
one (gradient order, 1 MiB first bucket). So the memories are kept and saved by parameter name,
and laid out again in whatever bucket holds the parameters when a bucket's layout changes.
Everything PowerSGD computes is per value or per matrix, so the resumed run computes exactly
what the uninterrupted one did.

The error memory is kept in unscaled units: under amp the gradients arrive multiplied by the
loss scale, which changes between steps, so it is scaled for the hook and unscaled after. A
step whose optimizer step is skipped (non-finite gradients) leaves the memories as they were
before it, instead of the inf/NaN it computed, which would poison every later step: torch
replaces each bucket's error memory with a new tensor every step, so the old one is kept by
reference, and the small Q factors, updated in place, are copied.

Under balance=ssp the exchange of step t is applied at step t + s, and torch's hook updates its
memories of a bucket in place while that bucket's all-reduces run: the next steps' exchanges on
one state would overwrite them. So there the run keeps s + 1 lanes, each a PowerSGD of its own
(memories, random generator, process group) taking every (s + 1)-th step: a lane's next
exchange comes after its last one was applied (or skipped, which restores the memories it was
formed with), no two exchanges in flight share memories, and each lane's collectives, some
launched from the completion of others, keep one order on every rank. `start_powerSGD_iter`
counts the run's steps. Checkpoints hold each lane's memories, and those its exchange in flight
was formed with (a skipped step after the resume restores them).
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from mgpu.checkpoint import numpy_rng_loaded, numpy_rng_saved
from mgpu.compression import CommHook
from mgpu.compression.commhook import CommHookCompression
from mgpu.errors import ConfigError

log = logging.getLogger("mgpu.compression")


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
        self.shapes: dict[str, torch.Size] = {}
        # bucket index -> (its parameters' names, the step its hook last ran in)
        self.layouts: dict[int, tuple[tuple[str, ...], int]] = {}
        # Memories by parameter name, of parameters whose bucket changed or that were loaded:
        # {"error": {name: values}, "q": {name: Q factor, flat}}
        self.by_name: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        self.steps = 0  # synchronised steps of this process
        # bucket index -> (error memory, copy of Q memory, P memory) before this step, None
        # where absent
        self.before: dict[int, tuple[torch.Tensor | None, ...]] = {}
        # Under ssp: one PowerSGD per step in flight, each taking every (s + 1)-th step.
        self.lanes: list[PowerSGD] = []
        # A lane resumed with an exchange in flight: the memories (by name) it was formed with.
        self.formed_with: dict[str, dict[str, torch.Tensor]] | None = None
        self.in_flight: list[torch.futures.Future] = []  # a lane's exchange not yet applied

    def comm_hook(self, model: nn.Module) -> CommHook:
        module = getattr(model, "module", model)
        self.shapes = {name: p.shape for name, p in module.named_parameters()}
        return super().comm_hook(model)

    def hook_state(self, model: nn.Module) -> PowerSGDState:
        self.state = PowerSGDState(process_group=model.process_group, **self.settings)
        return self.state

    def applied_after(self, steps: int) -> None:
        """Under ssp (`steps` > 0): `steps` + 1 lanes, each with a process group of its own."""
        super().applied_after(steps)
        if steps:
            ranks = dist.get_process_group_ranks(self._registered().process_group)
            self.lanes = [self.lane(dist.new_group(ranks)) for _ in range(steps + 1)]

    def lane(self, group: dist.ProcessGroup) -> PowerSGD:
        """A PowerSGD with these settings for this model, exchanging over `group`."""
        lane = PowerSGD(**self.settings)
        lane.shapes, lane.names, lane.world_size = self.shapes, self.names, self.world_size
        lane.state = PowerSGDState(process_group=group, **self.settings)
        return lane

    def end_step(self, applied: bool) -> None:
        """A skipped step leaves the memories as they were before it (under ssp: the lane of
        the exchange the step applied, as it was before that exchange)."""
        if self.lanes:
            step = self.steps - 1 - self.delay
            if step >= 0:
                self.lanes[step % len(self.lanes)].end_step(applied)
            return
        if not applied and self.before:
            for index, (error, q, p) in self.before.items():
                restore(self.state.error_dict, index, error)
                restore(self.state.q_memory_dict, index, q)
                # torch draws P and Q afresh only where P is absent: a skipped first step
                # must take both away, or the next one finds P without its Q.
                restore(self.state.p_memory_dict, index, p)
        elif not applied and self.formed_with is not None:  # resumed: by name, laid out anew
            for memory in (self.state.error_dict, self.state.p_memory_dict,
                           self.state.q_memory_dict):
                memory.clear()
            self.layouts = {}
            self.by_name = {kind: dict(pieces) for kind, pieces in self.formed_with.items()}
        self.before.clear()
        self.formed_with = None
        self.in_flight.clear()

    def hook(self, state, bucket):
        if self.lanes:
            return self.on_lane(bucket)
        self.follow_layout(state, bucket)
        index, scale = bucket.index(), self.grad_scale
        error, q = state.error_dict.get(index), state.q_memory_dict.get(index)
        self.before[index] = (error, None if q is None else q.clone(),
                              state.p_memory_dict.get(index))
        if scale is not None and error is not None:
            state.error_dict[index] = error * scale
        # torch tallies the elements it all-reduces for each tensor: the plain ones, or the P
        # and Q factors (exactly the sizes of its P/Q buffers); before `start_powerSGD_iter` it
        # all-reduces the whole bucket.
        tally = state.total_numel_after_compression
        plain = state.iter < state.start_powerSGD_iter
        future = powerSGD_hook(state, bucket)
        buffer = bucket.buffer()
        numel = buffer.numel() if plain else state.total_numel_after_compression - tally
        self.count_all_reduce(numel * buffer.element_size())
        if bucket.is_last():
            self.steps += 1
        if scale is None:
            return future

        def unscale_error(fut: torch.futures.Future) -> torch.Tensor:
            if index in state.error_dict:
                state.error_dict[index].div_(scale)
            return fut.value()

        return future.then(unscale_error)

    def on_lane(self, bucket) -> torch.futures.Future:
        """The bucket exchanged by the lane of this step, at the run's step count."""
        lane = self.lanes[self.steps % len(self.lanes)]
        lane.grad_scale = self.grad_scale
        lane.state.iter = self.steps  # torch counts on from here at the last bucket
        self.layouts = lane.layouts  # DDP's bucket layout, as the lanes see it
        future = lane.hook(lane.state, bucket)
        lane.in_flight.append(future)
        if bucket.is_last():
            self.steps += 1
        return future

    def metrics(self) -> dict[str, float]:
        for lane in self.lanes:  # their all-reduces' bytes: this compression's
            self.wire_bytes += lane.wire_bytes
            lane.wire_bytes = 0.0
        return super().metrics()

    # ---- memories by parameter name -------------------------------------------------------

    def compressed(self, names: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """(name, P length, Q length) of each matrix torch compresses in a bucket of these
        parameters, in the order of its P and Q memories: grouped by matrix shape in order of
        first appearance, bucket order within a group."""
        rank = self.settings["matrix_approximation_rank"]
        rate = self.settings["min_compression_rate"]
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name in names:
            shape = self.shapes[name]
            n, m = shape[0], math.prod(shape[1:])  # torch views each gradient as (rows, -1)
            r = min(n, m, rank)
            if (n + m) * r * rate < n * m:  # torch's rule: worth compressing
                groups.setdefault((n, m), []).append((name, n * r, m * r))
        return [matrix for group in groups.values() for matrix in group]

    def split_by_name(self, state: PowerSGDState, index: int, names: tuple[str, ...]
                      ) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket `index`'s memories, laid out for `names`, as {"error"/"q": {name: tensor}}."""
        found: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        error = state.error_dict.get(index)
        if error is not None:
            sizes = [math.prod(self.shapes[name]) for name in names]
            found["error"] = dict(zip(names, error.split(sizes), strict=True))
        q = state.q_memory_dict.get(index)
        if q is not None:
            matrices = self.compressed(names)
            if sum(length for _, _, length in matrices) != q.numel():
                raise RuntimeError("torch's PowerSGD Q memory is not laid out as expected")
            pieces = q.split([length for _, _, length in matrices])
            found["q"] = {name: piece for (name, _, _), piece in zip(matrices, pieces, strict=True)}
        return found

    def follow_layout(self, state: PowerSGDState, bucket) -> None:
        """Hand torch this bucket's memories in its current layout: where the layout changed
        (or state was loaded), from the memories by name."""
        names = tuple(self.names[id(p)] for p in bucket.parameters())
        index = bucket.index()
        if self.layouts.get(index, ((), -1))[0] != names:
            # The buckets not yet reduced in this step hold final memories: keep them by name.
            for old, (old_names, last_step) in list(self.layouts.items()):
                if last_step < self.steps:
                    for kind, pieces in self.split_by_name(state, old, old_names).items():
                        self.by_name[kind].update(pieces)
                    for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                        memory.pop(old, None)
                    del self.layouts[old]
            self.lay_out(state, index, names, bucket.buffer())
        self.layouts[index] = (names, self.steps)

    def lay_out(self, state: PowerSGDState, index: int, names: tuple[str, ...],
                like: torch.Tensor) -> None:
        """Bucket `index`'s memories from the ones by name, once PowerSGD has begun (before,
        torch creates them: error zero, Q random)."""
        if state.iter <= state.start_powerSGD_iter:
            return
        errors, qs = self.by_name["error"], self.by_name["q"]
        if state.use_error_feedback and all(name in errors for name in names):
            values = [errors.pop(name).reshape(-1) for name in names]
            state.error_dict[index] = torch.cat(values).to(like)
        matrices = self.compressed(names)
        if state.warm_start and all(name in qs for name, _, _ in matrices):
            q = [qs.pop(name) for name, _, _ in matrices]
            state.q_memory_dict[index] = torch.cat(q).to(like) if q else like.new_empty(0)
            # P is computed afresh every step; its memory must only exist, or torch draws Q anew.
            state.p_memory_dict[index] = like.new_empty(sum(p for _, p, _ in matrices))

    def state_dict(self) -> dict:
        """Step count, random generator, and the error and Q memories by parameter name (they
        restore into any bucket layout); under ssp each lane's, with the memories its exchange
        in flight was formed with."""
        if self.lanes:
            for lane in self.lanes:  # torch updates the memories as the exchanges complete
                for future in lane.in_flight:
                    future.wait()
            return {"steps": self.steps,
                    "lanes": [{**lane.state_dict(), "formed_with": lane.before_by_name()}
                              for lane in self.lanes]}
        state = self._registered()
        memories = {kind: dict(pieces) for kind, pieces in self.by_name.items()}
        for index, (names, _) in self.layouts.items():
            for kind, pieces in self.split_by_name(state, index, names).items():
                memories[kind].update(pieces)
        return {
            "iter": state.iter,
            "rng": numpy_rng_saved(state.rng.get_state()),
            **{kind: {name: t.clone() for name, t in pieces.items()}
               for kind, pieces in memories.items()},
        }

    def load_state_dict(self, saved: dict) -> None:
        state = self._registered()
        if "error" not in saved and "lanes" not in saved:  # saved with another compression
            log.info("compression=powersgd: the checkpoint holds no state of it (saved with "
                     "another compression): its memories start empty, at iteration 0")
            return
        if len(saved.get("lanes", ())) != len(self.lanes):
            log.info("compression=powersgd: the checkpoint's memories are for another number "
                     "of steps in flight (balance.staleness): they start empty, at iteration 0")
            return
        if self.lanes:
            self.steps = saved["steps"]
            for lane, own in zip(self.lanes, saved["lanes"], strict=True):
                lane.load_state_dict(own)
                lane.formed_with = own["formed_with"]
            return
        state.rng.set_state(numpy_rng_loaded(saved["rng"]))
        state.iter = saved["iter"]
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.clear()
        self.layouts = {}
        self.by_name = {kind: {name: t.clone() for name, t in saved[kind].items()}
                        for kind in ("error", "q")}

    def before_by_name(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The memories this lane's exchange in flight was formed with, by name (None where
        none is in flight)."""
        if self.formed_with is not None:
            return {kind: dict(pieces) for kind, pieces in self.formed_with.items()}
        if not self.before:
            return None
        before = SimpleNamespace(
            error_dict={i: e for i, (e, _, _) in self.before.items() if e is not None},
            q_memory_dict={i: q for i, (_, q, _) in self.before.items() if q is not None})
        found: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        for index in self.before:
            for kind, pieces in self.split_by_name(before, index, self.layouts[index][0]).items():
                found[kind].update({name: t.clone() for name, t in pieces.items()})
        return found

    def _registered(self) -> PowerSGDState:
        if self.state is None:
            raise RuntimeError("PowerSGD state exists once comm_hook(model) has run")
        return self.state


def restore(memory: dict[int, torch.Tensor], index: int, saved: torch.Tensor | None) -> None:
    """Put `saved` back as bucket `index`'s memory, or remove it where there was none."""
    if saved is None:
        memory.pop(index, None)
    else:
        memory[index] = saved
