"""Communication time, measured on DDP's comm-hook path.

DDP calls its comm hook once per gradient bucket, as soon as the bucket's gradients are ready,
and waits for the returned future at the end of backward. Wrapping the hook therefore sees
each collective's launch (the first launch of a step ends that rank's compute before
communication) and its completion (a callback on the future). Buckets queue behind each other on
the process group, so these intervals overlap: the step's communication time is their union
(`mgpu.monitor.timing.in_flight_s`), not their sum. The bytes those collectives put
on the wire depend on what the hook sends and by which collective: the compression counts
them (`mgpu/compression/commhook.py`), and the monitor divides them by the time measured here.

Any hook can be wrapped: `Trainer.build` hands the monitor the one hook an option owns (a
compression, or balance=ssp) and registers what `CommMeter.timed` returns. Where no option owns
one, DDP would all-reduce in C++ out of Python's sight, so while monitoring an all-reduce of the
bucket's mean (what DDP does by default) is registered instead, timed in one future callback
per bucket; without monitoring DDP keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mgpu.monitor.timing import clock_for

if TYPE_CHECKING:
    from mgpu.compression import CommHook

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

    def timed(self, hook: CommHook | None) -> CommHook:
        """(state, hook) timed; for no hook, a timed stand-in for DDP's built-in all-reduce."""
        state, function = hook if hook is not None else (None, allreduce_mean)
        return state, self.wrap(function)


def allreduce_mean(process_group, bucket):
    """DDP's default reduction: the bucket divided by the world size, summed over ranks.

    Unlike torch's `allreduce_hook` it returns the collective's own future, so the timing
    callback is the only Python run when the collective completes.
    """
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer().div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future()
