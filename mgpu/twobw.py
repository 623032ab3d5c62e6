"""PipeDream-2BW's schedule (Narayanan et al., ICML 2021): 1F1B with no flush between optimizer
steps, two weight versions per stage; `strategy.schedule=2bw`, one stage per pipeline rank.

A small driver of our own over each rank's stage module (torch's schedules must run every
micro-batch's forward and backward within one `step()` and clear their state at its end). Each
rank runs one endless 1F1B sequence: rank r of p keeps up to w = p - 1 - r micro-batches in
flight and alternates one forward and one backward; a training step (`step`) runs that sequence
until the next op would be the next step's first forward, so step t's last backwards (its
cooldown) run beside step t+1's first forwards (its warmup) and no rank waits for a flush.

Weight versions. Batch n runs, forward and backward, on version buffer n % 2. Its gradients are
complete on a rank after its last backward there, which on rank r comes w micro-batches into
step n+1; its update is applied at the end of step n+1 on every rank (the latest a rank can
wait while step n+2, the next user of buffer n % 2, has not started): buffer n % 2 takes the
newest weights (buffer (n+1) % 2, in use by batch n+1, which is only read) and the optimizer
steps it with batch n's gradients. So W(n) = W(n-1) - lr·∇f_n(W(n-2)), as one process applying
PipeDream-2BW's rule (W(0) standing for W(-1)). The stages' own parameters, which the optimizer,
evaluation, `model.pt` and checkpoints hold, alias the newest buffer (their storage is pointed
at it), so a rank holds two copies of its weights, not three; one copy of the weights per step
is the price of torch's optimizers stepping their parameters in place.

Nothing per step waits for another rank: every per-step exchange is started where its data is
ready and waited on a step later, when it has long arrived.
- The non-finite flag of batch n is all-reduced asynchronously from each rank's last backward
  of n and read before its update at the end of step n+1; where any rank found inf/NaN, every
  rank poisons its gradients, so the precision's local check skips the step everywhere (the
  precision's own per-step all-reduce is off for this model: `agrees_nonfinite`).
- The tied weights' gradients (first and last stage) are sent and received asynchronously at
  the same point and summed before the update.
- The loss is not broadcast: the last stage's rank returns the loss times the pipeline's size and
  the others 0, so the mean over all ranks that the log point takes (one all-reduce per log
  point) is the loss.

Evaluation, checkpoints and the end of training drain the pipeline first (`drain`): every
in-flight backward runs and every pending update is applied, so a checkpoint holds both versions
and nothing in flight, and a run resumed from it computes what the uninterrupted run does.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mgpu.loss import cross_entropy
from mgpu.precision.common import nonfinite_in

if TYPE_CHECKING:
    from mgpu.pipeline import Pipeline, Stages

#: Tags of the driver's point-to-point messages, apart from each other and from the untagged
#: sends of evaluation and shape discovery.
ACTIVATION_TAG, GRADIENT_TAG, TIED_TAG = 21, 22, 23


@dataclass
class InFlight:
    """A micro-batch whose forward ran on this rank's stage and whose backward is still to run."""

    batch: int
    given: torch.Tensor | None  # the received activation (None on the first stage)
    made: torch.Tensor  # the stage's output, or the loss on the last stage
    gradient: tuple | None = None  # (work, tensor): the posted receive of made's gradient


@dataclass
class Finished:
    """A batch whose backwards are all done on this rank, its update not yet applied."""

    batch: int
    flag: torch.Tensor  # non-finite flag, all-reduced over the pipeline in the background
    works: list = field(default_factory=list)  # that all-reduce and the tied exchange
    tied: dict[str, torch.Tensor] = field(default_factory=dict)  # the peer's tied gradients


class NoFlush:
    """The no-flush 1F1B sequence of one pipeline rank holding one stage, with its two weight
    versions (`Pipeline.versions`)."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        # The driver's own group, for its sends, receives and background all-reduces: a
        # rank issues a batch's all-reduce where it finishes the batch, a step apart from its
        # peers, and the run's collectives on the pipeline's group (log points, checkpoints)
        # must not fall in between. Every rank creates it (`new_group` is collective): one
        # pipeline group under strategy=pp, the only layout 2bw runs under.
        self.group = dist.new_group(dist.get_process_group_ranks(pipe.group))
        [self.stage_id] = pipe.stage_ids
        self.first = self.stage_id == 0
        self.last = self.stage_id == pipe.num_stages - 1
        # Micro-batches a rank keeps in flight: the 1F1B warmup of its stage.
        self.ahead = pipe.num_stages - 1 - self.stage_id
        own = pipe.modules
        self.versions = [copy.deepcopy(own), copy.deepcopy(own)]
        for version in self.versions:
            share_buffers(version, own)  # running statistics are the stages' own, not versioned
        point_at(own, self.versions[0])
        self.started = 0  # batches started; batch n runs on versions[n % 2]
        self.in_flight: deque[InFlight] = deque()
        self.done_in_batch: dict[int, int] = {}  # backwards done per batch
        self.finished: deque[Finished] = deque()
        # (work, tensor) of the activation and gradient sends of this step and of the one
        # before: a step waits for the one before's, received by then (each waited once: a
        # gloo send waited twice waits for a second send).
        self.sends: list[tuple] = []
        self.sent_before: list[tuple] = []
        self.shapes: tuple[torch.Tensor, torch.Tensor] | None = None  # input, output (meta)
        # The next forward's activation, its receive posted ahead (within a step: the last
        # forward of a step posts none, so nothing is left waiting when training ends).
        self.next_given: tuple | None = None
        #: The optimizer step of this rank's stages (the trainer's); called once per batch.
        self.update: Callable[[], None] | None = None

    @property
    def older(self) -> Stages:
        """The version before the newest (when drained): what the next batch runs on."""
        return self.versions[(self.started + 1) % 2]

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, divisor: float) -> torch.Tensor:
        """One batch into the pipeline: its forwards, and the backwards the 1F1B sequence puts
        before the next batch's first forward; then the update of the batch before, whose
        backwards are done on every rank by now. Returns what the rank adds to the loss (see the
        module docstring)."""
        pipe = self.pipe
        if self.shapes is None:
            examples = pipe.stage_examples(inputs)
            pipe.time_transfers(examples)
            [self.shapes] = examples
        self.started += 1
        batch = self.started
        module = self.versions[batch % 2][0]
        m = pipe.microbatches
        pieces = zip(inputs.tensor_split(m), labels.tensor_split(m), strict=True)
        losses: list[torch.Tensor] = []
        forwards = 0
        while forwards < m or len(self.in_flight) > self.ahead:
            if forwards < m and len(self.in_flight) <= self.ahead:
                forwards += 1
                losses.extend(self.forward(module, batch, *next(pieces), divisor,
                                           more=forwards < m))
            else:
                self.backward()
        while self.finished and self.finished[0].batch < batch:
            self.apply(self.finished.popleft())
        for work, _ in self.sent_before:
            self.wait(work)
        self.sent_before, self.sends = self.sends, []
        if not self.last:
            return torch.zeros((), device=pipe.device)
        return torch.stack(losses).mean() * pipe.size

    def drain(self) -> None:
        """Every in-flight backward and every pending update, on every rank (all call it)."""
        while self.in_flight:
            self.backward()
        while self.finished:
            self.apply(self.finished.popleft())
        for work, _ in self.sent_before + self.sends:
            self.wait(work)
        self.sent_before, self.sends = [], []

    def forward(self, module: torch.nn.Module, batch: int, inputs: torch.Tensor,
                labels: torch.Tensor, divisor: float, more: bool) -> list[torch.Tensor]:
        """One micro-batch's forward (`more`: another follows in this step, whose activation's
        receive is posted now); on the last stage its loss and, at once, its backward."""
        pipe = self.pipe
        given = None
        if not self.first:
            work, given = self.next_given or self.post_activation()
            self.next_given = self.post_activation() if more else None
            self.wait(work)
            given.requires_grad_(True)
        made = pipe.timed(module, "forward")(inputs if self.first else given)
        record = InFlight(batch, given, made)
        if self.last:
            with pipe.computing():
                loss = cross_entropy(made, labels)
            record.made = loss / divisor if divisor != 1 else loss
            self.in_flight.append(record)
            self.backward()
            return [loss.detach()]
        self.send(made.detach(), self.stage_id + 1, ACTIVATION_TAG)
        gradient = torch.empty_like(self.shapes[1], device=pipe.device)
        record.gradient = (self.receive(gradient, self.stage_id + 1, GRADIENT_TAG), gradient)
        self.in_flight.append(record)
        return []

    def post_activation(self) -> tuple:
        """(work, tensor): a posted receive of the next activation from the stage before."""
        given = torch.empty_like(self.shapes[0], device=self.pipe.device)
        return self.receive(given, self.stage_id - 1, ACTIVATION_TAG), given

    def backward(self) -> None:
        """The oldest in-flight micro-batch's backward, its input's gradient sent back."""
        record = self.in_flight.popleft()
        if record.gradient is None:  # the last stage: from the loss
            self.pipe.timed(torch.autograd.backward, "backward")(record.made)
        else:
            work, gradient = record.gradient
            self.wait(work)
            self.pipe.timed(torch.autograd.backward, "backward")(record.made, gradient)
        if not self.first:
            self.send(record.given.grad, self.stage_id - 1, GRADIENT_TAG)
        done = self.done_in_batch.get(record.batch, 0) + 1
        self.done_in_batch[record.batch] = done
        if done == self.pipe.microbatches:
            del self.done_in_batch[record.batch]
            self.finish(record.batch)

    def finish(self, batch: int) -> None:
        """Batch `batch`'s gradients are complete here: divided by its micro-batches (each
        micro-batch's loss is its mean), its non-finite flag all-reduced and its tied
        gradients exchanged, both in the background."""
        pipe = self.pipe
        version = self.versions[batch % 2]
        for param in version.parameters():
            if param.grad is not None:
                param.grad.div_(pipe.microbatches)
        flag = nonfinite_in(version.parameters(), pipe.device)
        done = Finished(batch, flag, [dist.all_reduce(flag, group=self.group, async_op=True)])
        if pipe.tied and (self.first or self.last):
            peer = pipe.stage_rank[pipe.num_stages - 1 if self.first else 0]
            for name in pipe.tied:
                own = version[0].get_parameter(name).grad
                theirs = torch.empty_like(own)
                done.works.append(dist.isend(own, group=self.group, group_dst=peer, tag=TIED_TAG))
                pipe.sent_bytes += own.nbytes
                done.works.append(self.receive(theirs, peer, TIED_TAG))
                done.tied[name] = theirs
        self.finished.append(done)

    def apply(self, done: Finished) -> None:
        """Batch `done.batch`'s update: its buffer takes the newest weights and the optimizer
        steps it (the stages' parameters pointed at it) with the batch's gradients."""
        pipe = self.pipe
        for work in done.works:
            self.wait(work)
        ran_on, newest = self.versions[done.batch % 2], self.versions[(done.batch + 1) % 2]
        for name, theirs in done.tied.items():  # first stage's + last stage's, on both ends
            own = ran_on[0].get_parameter(name).grad
            if self.first:
                own.add_(theirs)
            else:
                own.copy_(theirs.add_(own))
        point_at(pipe.modules, ran_on)
        with torch.no_grad():
            for param, value in zip(ran_on.parameters(), newest.parameters(), strict=True):
                param.copy_(value)
        for own, param in zip(pipe.modules.parameters(), ran_on.parameters(), strict=True):
            own.grad, param.grad = param.grad, None
        if done.flag.item():  # some rank found inf/NaN: every rank skips this update
            for own in pipe.modules.parameters():
                if own.grad is not None:
                    own.grad.fill_(float("nan"))
        self.update()

    def send(self, tensor: torch.Tensor, to: int, tag: int) -> None:
        """Start sending `tensor` to pipeline rank `to`; kept alive until it is waited for."""
        tensor = tensor.contiguous()
        work = dist.isend(tensor, group=self.group, group_dst=to, tag=tag)
        self.sends.append((work, tensor))
        self.pipe.sent_bytes += tensor.nbytes

    def receive(self, into: torch.Tensor, source: int, tag: int):
        """Start receiving into `into` from pipeline rank `source`."""
        return dist.irecv(into, group=self.group, group_src=source, tag=tag)

    def wait(self, work) -> None:
        """Wait for `work`, the time marked as a wait on transfers."""
        start = self.pipe.clock.mark()
        work.wait()
        self.pipe.waits.append((start, self.pipe.clock.mark()))


def point_at(own: torch.nn.Module, version: torch.nn.Module) -> None:
    """`own`'s parameters take `version`'s storage (no copy): the optimizer steps `version`."""
    for param, value in zip(own.parameters(), version.parameters(), strict=True):
        param.data = value.data


def share_buffers(version: torch.nn.Module, own: torch.nn.Module) -> None:
    """`version`'s buffers become `own`'s tensors."""
    for mine, theirs in zip(version.modules(), own.modules(), strict=True):
        for name, buffer in theirs.named_buffers(recurse=False):
            mine._buffers[name] = buffer
