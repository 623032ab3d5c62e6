"""Stale-synchronous data parallel: a rank may run up to `staleness` steps ahead of the slowest.

A DDP comm hook (`StaleGradients`) launches each step's bucket all-reduce asynchronously and
hands DDP, for step t, the averaged gradients of step t - s instead of step t. DDP waits only
for that older all-reduce, which has long arrived unless a peer is more than s steps behind; a
rank delayed now and then (jitter) no longer stalls the others every time. The first s steps
have no gradients to apply (there is no step t - s yet: the textbook delayed-gradient start):
they leave the weights and the optimizer state as they are. The last s all-reduces are left
unapplied.

Each step's averaged buffers are kept as views by parameter name, because DDP rebuilds its
buckets (order and grouping) after the first step of every run: a stale bucket is reassembled
in the current bucket's layout. Checkpoints hold the step count and the averaged gradients
still to be applied, by parameter name, so a resumed run applies exactly what the uninterrupted
one would. The average is DDP's own: each value times 1/W, then the sum (x * (1/W) and x / W
differ for a third of float32 values where W is not a power of two), so s = 0 is bitwise the
same as `balance=none`.

Under amp each step's averaged gradients carry the loss scale of the step they were computed
at, which has changed by the time they are applied: they are unscaled by their own scale
(`carried_scale`), and an overflow seen s steps late backs the scale off once.

With a compression that is a wire dtype (fp16, bf16) each step's bucket is sent in that dtype,
divided by the world size after the cast as torch's fp16/bf16_compress_wrapper does, and kept
so until the stale step uses it, when it is decompressed to the bucket's dtype; the compression
counts the bytes (in the wire dtype) as its own hook would. Checkpoints hold the queued
gradients in the wire dtype.

With a compression that is a comm hook of its own (onebit, powersgd), each step's bucket is
copied (DDP reuses its buffer for the next step) and handed to the compression's hook, whose
exchange then stands where the all-reduce would; the step that applies it is s steps later, and
the compression keeps what it learned from that exchange (its error feedback: what the message
missed; PowerSGD's Q factors) only then, and only if that step's update is applied
(`Compression.applied_after`). So a step's message is formed with the error feedback of the
exchanges already applied, and s = 0 is the compression alone.

Same data and split as `none`; the metrics add `balance/ahead_steps`: how many of its earlier
steps' all-reduces a rank found not yet completed when it finished a backward pass, the mean
since the last log point, the largest over ranks. An all-reduce completes once every rank has
started it, so this is how many steps beyond the one in progress a rank ran ahead of the
slowest (0 where ranks keep in step, at most `staleness` - 1). The step in progress does not
count: its all-reduce has just been launched and is in flight however close the ranks are.
Completion is read from the collective's work (`Work.is_completed`), which on NCCL means
finished on the GPU, not merely queued as `Future.done()` does. The age of the applied
gradients is no figure: it is `staleness` by construction (a param of the run).
"""

# No `from __future__ import annotations`: DDP checks the hook's `bucket` annotation at runtime.
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import GradBucket
from torch.futures import Future, collect_all

from mgpu.balance.equal import EqualSplit
from mgpu.compression.commhook import parameter_names
from mgpu.errors import ConfigError
from mgpu.runtime import gather_rows

if TYPE_CHECKING:
    from mgpu.compression import CommHook


def completed(tensor: torch.Tensor) -> Future:
    """A future that has `tensor`'s all-reduce result already, as `dist.all_reduce`'s has."""
    future: Future = Future()
    future.set_result([tensor])
    return future


class StaleGradients:
    """DDP comm hook state: the in-flight all-reduces of the last `staleness` + 1 steps."""

    def __init__(self, staleness: int, world_size: int, names: dict[int, str],
                 device: torch.device, wire: object = None,
                 compression_hook: "CommHook | None" = None) -> None:
        self.staleness, self.world_size, self.device = staleness, world_size, device
        # A compression whose wire dtype the gradients cross in, and which counts the bytes.
        self.wire = wire
        # A compression's own (state, hook), which exchanges each step's bucket in its place.
        self.compression_hook = compression_hook
        self.names = names  # id(parameter) -> name
        self.step = 0  # synchronising backward passes seen so far
        # step → {parameter name: (future, averaged bucket, the parameter's view of it)}
        self.sent: dict[int, dict[str, tuple[Future, torch.Tensor, torch.Tensor]]] = {}
        self.works: dict[int, list[dist.Work]] = {}  # step → its buckets' all-reduces
        self.applied: int | None = None  # the step whose gradients the last step got, if any
        # step → the loss scale its gradients carry (under amp), for the steps in `sent`
        self.scales: dict[int, torch.Tensor] = {}

    def hook(self, state: object, bucket: GradBucket) -> Future[torch.Tensor]:
        if self.compression_hook is not None:
            averaged, future = self.compressed(bucket)
            self.works.setdefault(self.step, []).append(future)
        else:
            if self.wire is None:
                averaged = bucket.buffer() * (1 / self.world_size)  # a copy: DDP reuses it
            else:
                self.wire.count_bucket(bucket)
                averaged = bucket.buffer().to(self.wire.wire_dtype).div_(self.world_size)
                self.wire.count_all_reduce(averaged.nbytes)
            work = dist.all_reduce(averaged, async_op=True)
            self.works.setdefault(self.step, []).append(work)
            future = work.get_future()
        params = bucket.parameters()
        views = self.sent.setdefault(self.step, {})
        for param, view in zip(params, averaged.split([p.numel() for p in params]), strict=True):
            views[self.names[id(param)]] = (future, averaged, view)
        result = self.stale(bucket)
        if bucket.is_last():
            source = self.step - self.staleness
            self.applied = source if source in self.sent else None
            self.sent.pop(source, None)
            self.step += 1
        return result

    def compressed(self, bucket: GradBucket) -> tuple[torch.Tensor, Future]:
        """The compression's exchange of a copy of `bucket`: the copy, which its hook fills
        with the decompressed average, and a future that holds it as all_reduce's does."""
        copy = BucketCopy(bucket)
        hook_state, hook = self.compression_hook
        return copy.buffer(), hook(hook_state, copy).then(lambda fut: [fut.value()])

    def stale(self, bucket: GradBucket) -> Future[torch.Tensor]:
        """Step t - s's averaged gradients in this bucket's layout and dtype (zeros before step
        s)."""
        dtype = bucket.buffer().dtype  # decompressed from the wire dtype, where there is one
        old = self.sent.get(self.step - self.staleness)
        if old is None:
            done: Future[torch.Tensor] = Future()
            done.set_result(torch.zeros_like(bucket.buffer()))
            return done
        pieces = [old[self.names[id(param)]] for param in bucket.parameters()]
        future, averaged, _ = pieces[0]
        views = [view for _, _, view in pieces]
        if all(p[1] is averaged for p in pieces) and _is_whole(views, averaged):
            # Same bucket as then: hand it over (`to` copies only to decompress).
            return future.then(lambda f: f.value()[0].to(dtype))
        futures = list({id(f): f for f, _, _ in pieces}.values())
        return collect_all(futures).then(lambda _: torch.cat(views).to(dtype))

    def earlier_in_flight(self) -> int:
        """This rank's steps between the one whose gradients it just applied and the one just
        synchronised whose all-reduce has not completed: every rank has started a completed
        one, so these are steps some peer has not reached yet. The applied step and those
        before it are done (their results were waited for), even where the work object says
        so a moment after its future. Forgets the works of those."""
        current = self.step - 1
        for step in [s for s, works in self.works.items() if s <= current - self.staleness
                     or all(completes(work) for work in works)]:
            del self.works[step]
        return sum(step < current for step in self.works)

    def state_dict(self) -> dict:
        """The step count and the averaged gradients not yet applied, by step and parameter
        name (waiting for their all-reduces, which every rank has started)."""
        queue = {}
        for step, views in self.sent.items():
            for future, _, _ in views.values():
                future.wait()
            queue[step] = {name: view.clone() for name, (_, _, view) in views.items()}
        scales = {step: float(scale) for step, scale in self.scales.items()}
        return {"step": self.step, "queue": queue, "scales": scales}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.sent = {}
        for step, grads in state["queue"].items():
            on_device = {name: grad.to(self.device) for name, grad in grads.items()}
            self.sent[step] = {name: (completed(g), g, g) for name, g in on_device.items()}
        self.scales = {step: torch.tensor(scale, device=self.device)
                       for step, scale in state.get("scales", {}).items()}


def completes(work: dist.Work | Future) -> bool:
    """Whether an all-reduce (its work) or a compression's exchange (its future) is done."""
    return work.is_completed() if isinstance(work, dist.Work) else work.done()


class BucketCopy:
    """A DDP bucket with its values copied, for a compression's hook whose exchange is used
    steps later: DDP refills the bucket's own buffer at the next step."""

    def __init__(self, bucket: GradBucket) -> None:
        self.values, self.params = bucket.buffer().clone(), bucket.parameters()
        self.position, self.last = bucket.index(), bucket.is_last()

    def buffer(self) -> torch.Tensor:
        return self.values

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's piece of the copy, shaped as the parameter (views)."""
        pieces = self.values.split([p.numel() for p in self.params])
        return [piece.view_as(p) for piece, p in zip(pieces, self.params, strict=True)]

    def index(self) -> int:
        return self.position

    def is_last(self) -> bool:
        return self.last


def _is_whole(views: list[torch.Tensor], buffer: torch.Tensor) -> bool:
    """True if the views tile `buffer` in order: the old bucket has the current one's layout."""
    offset = 0
    for view in views:
        if view.storage_offset() != offset:
            return False
        offset += view.numel()
    return offset == buffer.numel()


class StaleSynchronous(EqualSplit):
    measures = True
    needs_comm_hook = True
    # fp16/bf16: the stale all-reduce is sent in that dtype; onebit, powersgd: its exchange,
    # run by this hook, stands in for the all-reduce
    carries_compression = True
    stateful = True  # the averaged gradients still to be applied
    exact = False  # step t applies the gradients of step t - staleness

    def __init__(self, staleness: int = 2) -> None:
        if staleness < 0:
            raise ConfigError(f"balance.staleness={staleness}: must be >= 0 (0 = synchronous)")
        self.staleness = staleness
        self.ahead = 0

    def comm_hook(self, model: nn.Module, compression: object = None,
                  compression_hook: "CommHook | None" = None) -> "CommHook":
        """The stale-gradient hook and its in-flight steps, keyed by `model`'s parameter names,
        sending in `compression`'s wire dtype where it has one, else exchanging through the
        compression's own `compression_hook` where it has one (told that its exchanges are
        applied `staleness` steps later). No state for DDP to hand it: the hook's object holds
        everything."""
        runtime = self.runtime
        wire = compression if getattr(compression, "wire_dtype", None) is not None else None
        if wire is not None:
            compression_hook = None
        if compression_hook is not None:
            compression.applied_after(self.staleness)
        self.stale = StaleGradients(self.staleness, runtime.world_size, parameter_names(model),
                                    runtime.device, wire, compression_hook)
        return None, self.stale.hook

    def carried_scale(self, grad_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The loss scale of the step whose gradients are applied now: each step's averaged
        gradients keep the scale they were computed under (amp changes it between steps)."""
        if grad_scale is None:
            return None
        stale = self.stale
        stale.scales[stale.step - 1] = grad_scale.clone()  # the step just synchronised
        carried = stale.scales.get(stale.applied) if stale.applied is not None else None
        stale.scales = {step: s for step, s in stale.scales.items() if step in stale.sent}
        return carried

    def has_gradients(self) -> bool:
        """False in the first `staleness` steps: no averaged gradients are due yet."""
        return self.stale.applied is not None

    def after_backward(self) -> None:
        super().after_backward()
        self.ahead += self.stale.earlier_in_flight()

    def metrics(self) -> dict[str, float]:
        steps = self.clock.totals()["steps"] - self.logged["steps"]
        metrics = super().metrics()
        ahead = gather_rows([self.ahead / max(steps, 1)], self.runtime)[:, 0]
        self.ahead = 0
        metrics["balance/ahead_steps"] = float(ahead.max())
        return metrics

    def state_dict(self) -> dict:
        return self.stale.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if "queue" in state:  # else saved with another balance option: start as a fresh run
            self.stale.load_state_dict(state)
