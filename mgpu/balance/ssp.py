"""Stale-synchronous data parallel: a rank may run up to `staleness` steps ahead of the slowest.

A DDP comm hook (`StaleGradients`) launches each step's bucket all-reduce asynchronously and
hands DDP, for step t, the averaged gradients of step t - s instead of step t. DDP waits only
for that older all-reduce, which has long arrived unless a peer is more than s steps behind; a
rank delayed now and then (jitter) no longer stalls the others every time. The first s steps
apply a zero gradient (there is no step t - s yet: the textbook delayed-gradient start), and
the last s all-reduces are left unapplied.

Each step's averaged buffers are kept as per-parameter views, because DDP rebuilds its buckets
(order and grouping) after the first step: a stale bucket is reassembled in the current
bucket's layout. With s = 0 the hook hands back the current step's all-reduce, computed as
DDP's own hook does (divide by the world size, then sum), so the result is bitwise the same as
`balance=none`.

Same data and split as `none`; the metrics add `balance/staleness_steps` (age of the applied
gradients) and `balance/ahead_steps` (how many of its own steps a rank had in flight, not yet
completed by every rank, when it finished a backward pass: how far ahead it actually ran).
"""

# No `from __future__ import annotations`: DDP checks the hook's `bucket` annotation at runtime.
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import GradBucket
from torch.futures import Future, collect_all

from mgpu.balance.clock import gather_rows
from mgpu.balance.none import EqualSplit
from mgpu.errors import ConfigError
from mgpu.runtime import Runtime


class StaleGradients:
    """DDP comm hook state: the in-flight all-reduces of the last `staleness` + 1 steps."""

    def __init__(self, staleness: int, world_size: int) -> None:
        self.staleness, self.world_size = staleness, world_size
        self.step = 0  # synchronising backward passes seen so far
        # step → {parameter data pointer: (future, averaged bucket, the parameter's view of it)}
        self.sent: dict[int, dict[int, tuple[Future, torch.Tensor, torch.Tensor]]] = {}

    def hook(self, state: object, bucket: GradBucket) -> Future[torch.Tensor]:
        averaged = bucket.buffer() / self.world_size  # a copy: DDP reuses the bucket buffer
        future = dist.all_reduce(averaged, async_op=True).get_future()
        views = self.sent.setdefault(self.step, {})
        offset = 0
        for param in bucket.parameters():
            views[param.data_ptr()] = (future, averaged, averaged[offset : offset + param.numel()])
            offset += param.numel()
        result = self.stale(bucket)
        if bucket.is_last():
            self.sent.pop(self.step - self.staleness, None)
            self.step += 1
        return result

    def stale(self, bucket: GradBucket) -> Future[torch.Tensor]:
        """Step t - s's averaged gradients in this bucket's layout (zeros before step s)."""
        old = self.sent.get(self.step - self.staleness)
        if old is None:
            done: Future[torch.Tensor] = Future()
            done.set_result(torch.zeros_like(bucket.buffer()))
            return done
        pieces = [old[param.data_ptr()] for param in bucket.parameters()]
        future, averaged, _ = pieces[0]
        views = [view for _, _, view in pieces]
        if all(p[1] is averaged for p in pieces) and _is_whole(views, averaged):
            return future.then(lambda f: f.value()[0])  # same bucket as then: hand it over
        futures = list({id(f): f for f, _, _ in pieces}.values())
        return collect_all(futures).then(lambda _: torch.cat(views))

    def in_flight(self) -> int:
        """Steps of this rank whose all-reduce has not completed yet."""
        return sum(not all(f.done() for f, _, _ in views.values()) for views in self.sent.values())


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
    stateful = True  # the averaged gradients still to be applied
    exact = False  # step t applies the gradients of step t - staleness

    def __init__(self, staleness: int = 2) -> None:
        if staleness < 0:
            raise ConfigError(f"balance.staleness={staleness}: must be >= 0 (0 = synchronous)")
        self.staleness = staleness
        self.ahead = 0

    def attach(self, model: nn.Module, rt: Runtime, job: dict) -> None:
        super().attach(model, rt, job)
        self.stale = StaleGradients(self.staleness, rt.world_size)
        model.register_comm_hook(None, self.stale.hook)

    def after_backward(self) -> None:
        super().after_backward()
        self.ahead += self.stale.in_flight()

    def metrics(self) -> dict[str, float]:
        steps = self.clock.totals()["steps"] - self.logged["steps"]
        metrics = super().metrics()
        ahead = gather_rows([self.ahead / max(steps, 1)], self.rt)[:, 0]
        self.ahead = 0
        applied = self.staleness if self.stale.step > self.staleness else 0
        return {**metrics, "balance/staleness_steps": float(applied),
                "balance/ahead_steps": float(ahead.max())}
