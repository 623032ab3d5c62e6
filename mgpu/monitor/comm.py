"""Communication time, measured on DDP's comm-hook path.

DDP calls its comm hook once per gradient bucket, as soon as the bucket's gradients are ready,
and waits for the returned future at the end of backward. Wrapping the hook therefore sees
each collective's launch (the first launch of a step ends that rank's compute before
communication) and its completion (a callback on the future). The bytes those collectives put
on the wire depend on what the hook sends and by which collective: the compression counts
them (`mgpu/compression/commhook.py`), and the monitor divides them by the time measured here.

Any hook can be wrapped: while `CommMeter.intercept(model)` is open, a compression that calls
`model.register_comm_hook(state, hook)` registers the timed wrapper of its own hook instead;
if nothing registered a hook, an all-reduce of the bucket's mean (what DDP does by default) is
registered, timed in one future callback per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mgpu.monitor.timing import clock_for

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


class CommMeter:
    """Collects (start, end) of every bucket's communication the wrapped hook runs in a step."""

    def __init__(self, device: torch.device) -> None:
        self.clock = clock_for(device)
        self.first: Any = None
        self.collectives: list[list] = []

    def wrap(self, hook: Hook) -> Hook:
        """`hook`, timed from its launch to the completion of the future it returns."""

        # No annotations: DDP checks them, and this module's are strings (future annotations).
        def timed_hook(state, bucket):
            start = self.clock.mark()
            if self.first is None:
                self.first = start
            record = [start, None]
            self.collectives.append(record)

            def done(fut: torch.futures.Future) -> torch.Tensor:
                record[1] = self.clock.mark()  # on CUDA: on the stream that waits for the result
                value = fut.value()
                return value[0] if isinstance(value, list) else value  # a bare collective's

            return hook(state, bucket).then(done)

        timed_hook.__qualname__ = f"timed({getattr(hook, '__qualname__', repr(hook))})"
        return timed_hook

    def take_step(self) -> tuple[Any, list[tuple[Any, Any]]]:
        """The step's first launch mark and its collectives; resets for the next step.

        DDP has waited for every hook's future before backward returns, so all are complete.
        """
        first, collectives = self.first, [tuple(c) for c in self.collectives if c[1] is not None]
        self.first, self.collectives = None, []
        return first, collectives

    @contextmanager
    def intercept(self, model: Any) -> Iterator[None]:
        """Time whatever hook is registered on `model` inside; default to a timed all-reduce."""
        if not isinstance(model, DistributedDataParallel) or model._comm_hooks:
            # Not DDP, or a hook was registered earlier, outside this block: DDP takes one hook
            # only, so it stays untimed (its collectives report no comm figures).
            yield
            return
        registered = []

        def register_timed(state: Any, hook: Hook) -> None:
            registered.append(hook)
            DistributedDataParallel.register_comm_hook(model, state, self.wrap(hook))

        model.register_comm_hook = register_timed
        try:
            yield
        finally:
            del model.register_comm_hook
        if not registered:
            model.register_comm_hook(None, self.wrap(allreduce_mean))


def allreduce_mean(process_group, bucket):
    """DDP's default reduction: the bucket divided by the world size, summed over ranks.

    Unlike torch's `allreduce_hook` it returns the collective's own future, so the timing
    callback is the only Python run when the collective completes.
    """
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer().div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future()
