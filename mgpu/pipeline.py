"""A model cut into pipeline stages over a process group, driven by a torch.distributed.pipelining
schedule: the machinery shared by strategy=pp and the pp dimension of strategy=hybrid."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import DTensor

from mgpu.errors import ConfigError
from mgpu.loss import cross_entropy
from mgpu.meter import local_peak_bytes
from mgpu.monitor.timing import clock_for
from mgpu.precision.padding import unpad_state_dict
from mgpu.twobw import NoFlush


@dataclass(frozen=True)
class Schedule:
    """A torch.distributed.pipelining schedule as `strategy.schedule` names it."""

    #: Its class in torch.distributed.pipelining ("": our own, `NoFlush`), and the first torch
    #: release that has what it needs.
    torch_class: str
    since: str
    #: Model stages each pipeline rank holds.
    per_rank: int = 1
    #: How stages sit on ranks: "loop" (stage s on rank s % p) or "v" (rank r holds stages r
    #: and 2p-1-r, so the first and the last stage share rank 0).
    placement: str = "loop"
    #: torch's rule for its micro-batches beyond one per rank: "rounds" (a multiple of
    #: max(1, m // p) rounds), "stages" (at least as many as stages).
    microbatch_rule: str = ""
    #: Backward split in two (zero bubble): input gradients first, weight gradients later.
    split_backward: bool = False
    #: Weight-gradient passes a zero-bubble schedule moves into each of its p - 1 fill-and-
    #: drain slots, so its bubble is (p - 1)(T_F + T_B - k T_W) per stage's micro-batch times
    #: (T_B: the input gradients): 1 for ZB-H1, 2 for ZB-V (0 when T_F = T_B = T_W).
    weight_passes_in_bubble: int = 0
    #: PipeDream-2BW: no flush between optimizer steps, so each step's gradient is taken at
    #: the weights one optimizer step older than the stages' newest, W(t+1) = W(t) -
    #: lr·∇f(W(t-1)), two weight versions per stage (`NoFlush`, our own driver).
    stale: bool = False


SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", "2.4"),
    "1f1b": Schedule("Schedule1F1B", "2.4"),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", "2.4", 2, microbatch_rule="rounds"),
    "looped_bfs": Schedule("ScheduleLoopedBFS", "2.4", 2),
    "interleaved_zb": Schedule("ScheduleInterleavedZeroBubble", "2.5", 2,
                               microbatch_rule="rounds", split_backward=True,
                               weight_passes_in_bubble=1),
    "zbv": Schedule("ScheduleZBVZeroBubble", "2.6", 2, "v", "stages", split_backward=True,
                    weight_passes_in_bubble=2),
    "dualpipev": Schedule("ScheduleDualPipeV", "2.9", 2, "v", "stages", split_backward=True),
    "2bw": Schedule("", "2.4", stale=True),
}
# Most dims of the logits `predict` hands every rank: (batch, classes) or (batch, tokens, vocab).
MAX_DIMS = 4
# The dtypes a stage may hand the next one (fp32, or what autocast computes in), sent as their
# index here ahead of the tensor.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def stages_per_rank(schedule: str) -> int:
    """Model stages each rank holds under `schedule`: two for the looped and V schedules."""
    return SCHEDULES[schedule].per_rank


def stage_ids(schedule: str, rank: int, ranks: int) -> list[int]:
    """The stages pipeline rank `rank` of `ranks` holds under `schedule`, in model order."""
    spec = SCHEDULES[schedule]
    if spec.placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(spec.per_rank)]


def schedule_class(schedule: str, available: object = pipelining) -> type:
    """`schedule`'s torch class, looked up in `available` (this torch's pipelining module); a
    ConfigError naming the torch that first has it where this one does not."""
    spec = SCHEDULES[schedule]
    if not spec.torch_class:  # our own driver (2bw)
        return NoFlush
    cls = getattr(available, spec.torch_class, None)
    if cls is None:
        raise ConfigError(
            f"strategy.schedule={schedule}: needs torch >= {spec.since} "
            f"(torch.distributed.pipelining.{spec.torch_class}), this is torch "
            f"{torch.__version__}; use another schedule or a newer torch"
        )
    return cls


def check_pipeline(
    global_batch: int, schedule: str, microbatches: int, pp: int, dp: int, sharded: bool = False,
    tp: int = 1,
) -> None:
    """The rules a pipeline of `pp` ranks puts on its own settings (parent, before launch),
    its stages `sharded` by FSDP2 or not and split over `tp` ranks; those it puts on other
    groups are in `mgpu.support`."""
    local_batch = global_batch // dp
    if schedule not in SCHEDULES:
        raise ConfigError(f"strategy.schedule={schedule}: use one of {', '.join(SCHEDULES)}")
    schedule_class(schedule)
    spec = SCHEDULES[schedule]
    if sharded and spec.split_backward:
        raise ConfigError(
            f"strategy.schedule={schedule}: strategy=hybrid shards each stage with FSDP2, whose "
            f"gradients torch's split backward (input gradients now, weight gradients later) "
            f"leaves wrong (torch {torch.__version__}, against one process); with "
            f"strategy=hybrid use gpipe, 1f1b, interleaved_1f1b or looped_bfs, or strategy=pp"
        )
    if spec.stale and (sharded or tp > 1):
        raise ConfigError(
            f"strategy.schedule={schedule}: keeps each stage's two weight versions in plain "
            f"tensors its own parameters point at, which FSDP2's sharded and tensor "
            f"parallelism's DTensor parameters do not allow; use strategy=pp"
        )
    if microbatches < pp:
        raise ConfigError(
            f"strategy.microbatches={microbatches}: must be >= the {pp} pipeline stages, "
            f"or ranks sit idle; use strategy.microbatches={pp} or more"
        )
    stages = pp * spec.per_rank
    if spec.microbatch_rule == "stages" and microbatches < stages:
        raise ConfigError(
            f"strategy.microbatches={microbatches}: strategy.schedule={schedule} needs one per "
            f"stage, {stages} ({spec.per_rank} on each of the {pp} pipeline ranks); use "
            f"strategy.microbatches={stages} or more"
        )
    rounds = max(1, microbatches // pp)
    if spec.microbatch_rule == "rounds" and microbatches % rounds:
        raise ConfigError(
            f"strategy.microbatches={microbatches}: strategy.schedule={schedule} runs them in "
            f"{rounds} rounds over the {pp} pipeline ranks and needs a multiple of {rounds}; "
            f"use a multiple of {pp}"
        )
    if local_batch % microbatches:
        raise ConfigError(
            f"strategy.microbatches={microbatches}: must divide the batch of {local_batch} each "
            f"pipeline receives (data.batch_size / data-parallel degree)"
        )


def check_no_flush(schedule: str, microbatches: int, grad_accum: int,
                   loss_scaling: bool) -> None:
    """What a no-flush schedule (2bw) cannot run with (parent, before launch)."""
    if not SCHEDULES[schedule].stale:
        return
    if grad_accum > 1:
        raise ConfigError(
            f"train.grad_accum={grad_accum}: strategy.schedule={schedule} keeps micro-batches "
            f"in flight across optimizer steps, one schedule step each; use train.grad_accum=1 "
            f"and strategy.microbatches={microbatches * grad_accum}"
        )
    if loss_scaling:
        raise ConfigError(
            f"precision=amp: strategy.schedule={schedule} applies each step's gradients a step "
            f"later, under a loss scale the scaler may have changed since; use precision=bf16 "
            f"or fp32"
        )


def scales_grads(schedule: type) -> bool:
    """Whether this torch's `schedule` divides gradients by its micro-batches itself (torch >=
    2.7 does unless told `scale_grads=False`; 2.6 has no such option)."""
    return "scale_grads" in inspect.signature(schedule.__init__).parameters


# The pipeline whose schedule step runs now in this process (None: none), whose marks the
# schedule's waits on its sends and receives go to (`watch_transfers`).
_stepping: Pipeline | None = None


def watch_transfers() -> None:
    """Mark every wait torch's schedules make on their sends and receives, and count the bytes
    they send, for the pipeline stepping now: the schedules call `_wait_batch_p2p` and
    `_batch_p2p` by their module's name, so both are wrapped there, once per process; what they
    do is left as it is."""
    wait, issue = torch_schedules._wait_batch_p2p, torch_schedules._batch_p2p
    if getattr(wait, "marks_transfers", False):
        return

    def marked(work: list) -> None:
        pipe = _stepping
        if pipe is None:
            return wait(work)
        start = pipe.clock.mark()
        try:
            return wait(work)
        finally:
            pipe.waits.append((start, pipe.clock.mark()))

    def counted(ops: list, *args: Any, **kwargs: Any) -> list:
        if _stepping is not None:
            _stepping.sent_bytes += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return issue(ops, *args, **kwargs)

    marked.marks_transfers = True
    torch_schedules._wait_batch_p2p = marked
    torch_schedules._batch_p2p = counted


class Stages(nn.ModuleList):
    """This rank's pipeline stages: what the run trains and checkpoints. The list itself is
    never called (the schedule calls each stage), so what must act on a stage's compute hooks
    in here: each of `after_compute` is called after every forward or backward of one
    micro-batch on a stage, with "forward" or "backward" and the compute's start and end marks
    (`clock_for`), e.g. a simulated straggler's delay."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        super().__init__(modules)
        self.after_compute: list[Callable[[str, Any, Any], None]] = []
        #: Ranks agree on non-finite gradients themselves (a no-flush pipeline, `NoFlush`),
        #: so the precision leaves its per-step all-reduce of the flag out.
        self.agrees_nonfinite = False


class Pipeline:
    """This rank's stages of `model`, their schedule, and the figures of its bubble."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        device: torch.device,
        schedule: str,
        microbatches: int,
        prepare_stage: Callable[[nn.Module], nn.Module],
    ) -> None:
        self.group = group
        self.device = device
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.schedule_name = schedule
        per_rank = stages_per_rank(schedule)
        self.num_stages = self.size * per_rank
        # Weights both ends hold: the first and the last stage (one stage holds it once).
        self.tied = model.tied_parameters() if self.num_stages > 1 else ()
        self.stage_ids = stage_ids(schedule, self.rank, self.size)
        # Where each stage lives: looped (stage s on rank s % size) or in a V.
        self.stage_rank = {s: r for r in range(self.size)
                           for s in stage_ids(schedule, r, self.size)}
        self.modules = Stages(
            prepare_stage(copy.deepcopy(model).pipeline_stage(s, self.num_stages).to(device))
            for s in self.stage_ids
        )
        self.schedule_class = schedule_class(schedule)
        # Set for each step: the factor the loss is multiplied by before the schedule's
        # backward (amp's loss scale; None: not scaled), and the number the step's micro-batch
        # mean is divided by (the trainer's train.grad_accum micro-batches per optimizer step).
        self.loss_scale: torch.Tensor | None = None
        self.divisor = 1.0
        # Within `accumulating`: this step's gradients are added to by a later one before the
        # optimizer step, so the tied weights' copies are not summed yet.
        self.accumulate = False
        # scale_grads=False: torch divides every parameter's whole .grad by n_microbatches at
        # the end of each step, which would divide gradients accumulated over earlier steps
        # again; they are divided once, after the optimizer step's last schedule step. torch
        # 2.6's schedules have no such option and divide nothing.
        self.microbatches = microbatches
        # Built at the first step, from the shapes one micro-batch takes (`build_schedule`).
        self.schedule = None
        # PipeDream-2BW's driver and its two weight versions (None: torch's schedules).
        self.no_flush = NoFlush(self) if SCHEDULES[schedule].stale else None
        self.modules.agrees_nonfinite = self.no_flush is not None
        # Each step fills and drains the pipeline, so accumulating over steps leaves the
        # bubble of one step as it is (Megatron's micro-batches x accum in one schedule would
        # shrink it; torch's schedules take a fixed n_microbatches). Without a flush, the
        # steady state has none: only drains (evaluation, checkpoints) fill and drain.
        self.theory_bubble = (self.size - 1) / (per_rank * microbatches + self.size - 1)
        if self.no_flush is not None:
            self.theory_bubble = 0.0
        self.weight_passes_in_bubble = SCHEDULES[schedule].weight_passes_in_bubble
        # Marks (perf_counter on CPU, CUDA events on the current stream on GPU), read at log
        # points: a stage's compute of each micro-batch, and each whole schedule step.
        self.clock = clock_for(device)
        self.busy: dict[str, list[tuple]] = {"forward": [], "backward": [], "weight": []}
        self.steps: list[tuple] = []
        # The schedule's waits on its sends and receives (`watch_transfers`).
        self.waits: list[tuple] = []
        # Seconds one step's messages take to reach this rank once sent (`time_transfers`).
        self.transfer_s_per_step = 0.0
        # Bytes this rank sent point to point in training steps since the last log point.
        self.sent_bytes = 0

    def build_schedule(self, inputs: torch.Tensor) -> None:
        """The stages and their schedule, each stage given its input and output shapes and
        dtypes up front (`stage_examples`). Given none, torch infers them at the first step by
        running each stage's forward in training mode, on a real micro-batch at the first stage
        and on uninitialised memory at the others: BatchNorm's running statistics take an extra
        update, from garbage (a CNN's stages would then evaluate with them)."""
        examples = self.stage_examples(inputs)
        self.time_transfers(examples)
        stages = [
            PipelineStage(module, s, self.num_stages, self.device, input_args=given,
                          output_args=made, group=self.group)
            for module, s, (given, made) in zip(self.modules, self.stage_ids, examples,
                                                strict=True)
        ]
        for stage in stages:
            stage.forward_one_chunk = self.timed(stage.forward_one_chunk, "forward")
            stage.backward_one_chunk = self.timed(stage.backward_one_chunk, "backward")
            # Zero-bubble schedules run the weights' gradient apart, later (torch >= 2.5).
            if hasattr(stage, "backward_weight_one_chunk"):
                stage.backward_weight_one_chunk = self.timed(stage.backward_weight_one_chunk,
                                                             "weight")
        watch_transfers()
        no_scaling = {"scale_grads": False} if scales_grads(self.schedule_class) else {}
        self.schedule = self.schedule_class(
            stages if len(stages) > 1 else stages[0], n_microbatches=self.microbatches,
            loss_fn=self.scaled_loss, **no_scaling,
        )

    def stage_examples(self, inputs: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per stage of this rank: a meta tensor like its input and one like its output for one
        micro-batch of `inputs`, as the schedule will pass them (activations requiring grad).

        Found by passing the first micro-batch through the stages in evaluation mode without
        gradients, under the caller's autocast (which sets the dtypes): nothing a step keeps
        changes (no running statistics, no random draws)."""
        modes = [module.training for module in self.modules]
        examples = []
        hidden = inputs.tensor_split(self.microbatches)[0]
        with torch.no_grad():
            for module, s in zip(self.modules, self.stage_ids, strict=True):
                module.eval()
                # Where this rank holds the stage before too (one rank, a V), passed in place.
                if s > 0 and self.stage_rank[s - 1] != self.rank:
                    hidden = self.receive(self.stage_rank[s - 1])
                output = module(hidden)
                examples.append((like(hidden, requires_grad=s > 0),
                                 like(output, requires_grad=True)))
                if s < self.num_stages - 1 and self.stage_rank[s + 1] != self.rank:
                    self.send(output, self.stage_rank[s + 1])
                hidden = output
        for module, mode in zip(self.modules, modes, strict=True):
            module.train(mode)
        return examples

    def timed(self, compute: Callable, kind: str) -> Callable:
        """`compute` (a stage's `kind`, forward or backward, of one micro-batch), marked as busy
        time; then the stages' `after_compute` hooks, whose time (a simulated straggler's
        delay, standing for slower compute) is busy time too."""

        def run(*args, **kwargs):
            start = self.clock.mark()
            try:
                result = compute(*args, **kwargs)
                end = self.clock.mark()
                for hook in self.modules.after_compute:
                    hook(kind, start, end)
                return result
            finally:
                self.busy[kind].append((start, self.clock.mark()))

        return run

    @property
    def holds_last(self) -> bool:
        """This rank holds the last stage (the loss): the last rank, or rank 0 in a V."""
        return self.stage_rank[self.num_stages - 1] == self.rank

    @property
    def last_rank(self) -> int:
        """Global rank of the last stage's holder."""
        return dist.get_global_rank(self.group, self.stage_rank[self.num_stages - 1])

    def scaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch: the schedule runs backward from it itself,
        so the loss is divided here by `divisor` (its schedule step's weight in the optimizer
        step), and a loss scale goes in here too (in fp32, as amp scales a loss)."""
        with self.computing():
            loss = cross_entropy(logits, labels)
            if self.divisor != 1:
                loss = loss / self.divisor
            return loss if self.loss_scale is None else loss.float() * self.loss_scale

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Steps whose gradients a later step of the same optimizer step adds to: the tied
        weights' copies are summed once, after the last (summing the accumulated gradients
        at every step would count the earlier steps' twice)."""
        self.accumulate = True
        try:
            yield
        finally:
            self.accumulate = False

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor,
                         loss_scale: torch.Tensor | None = None,
                         divisor: float = 1.0) -> torch.Tensor:
        """One schedule step over all micro-batches, each micro-batch's loss divided by
        `divisor` and multiplied by `loss_scale` before backward (amp); after the optimizer
        step's last schedule step (outside `accumulating`) the gradients are divided by the
        micro-batches per schedule step, so `divisor` steps give the mean gradient of all their
        micro-batches. Returns the mean loss, unscaled, sent from the last stage."""
        if self.no_flush is not None:  # its own sequence; amp's loss scale is refused with it
            start = self.clock.mark()
            loss = self.no_flush.step(inputs, labels, divisor)
            self.steps.append((start, self.clock.mark()))
            return loss
        if self.schedule is None:
            self.build_schedule(inputs)
        start = self.clock.mark()
        self.loss_scale, self.divisor = loss_scale, divisor
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.rank == 0 else ()
        with self.stepping():
            self.schedule.step(*args, target=labels, losses=losses)
            if not self.accumulate:
                self.divide_gradients()
                self.add_tied_gradients()
        self.steps.append((start, self.clock.mark()))
        last = self.holds_last
        loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=self.device)
        if divisor != 1:
            loss = loss * divisor  # the micro-batches' mean loss, undivided
        if loss_scale is not None:
            loss = loss / loss_scale
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """A training step of this pipeline: the schedule's waits on its sends and receives are
        marked as its own, and what it sends is counted (`watch_transfers`, `send`)."""
        global _stepping
        _stepping = self
        try:
            yield
        finally:
            _stepping = None

    @property
    def older(self) -> Stages | None:
        """PipeDream-2BW's older weight version of this rank's stages, W(t-1), when drained
        (None: every other schedule)."""
        return self.no_flush.older if self.no_flush is not None else None

    def drain(self) -> None:
        """Run every micro-batch still in flight and apply every pending update (a no-flush
        schedule; the others drain every step). Every pipeline rank calls it."""
        if self.no_flush is not None:
            self.no_flush.drain()

    def restart_delay(self) -> None:
        """The older version set to the stages' weights, where a run starts from weights
        without one (a checkpoint of another schedule): W(-1) = W(0)."""
        with torch.no_grad():
            for own, older in zip(self.modules.parameters(), self.older.parameters(),
                                  strict=True):
                older.copy_(own)

    def time_transfers(self, examples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Measure, once, the seconds a step's messages take to reach this rank: each stage
        boundary it sits on carries m activations forward and m gradients back, of one shape;
        a ping-pong of that shape with the rank across the boundary gives one message's time.
        A marked wait longer than that is a wait on the peer's schedule (`metrics`).

        Every pipeline rank calls it; boundaries are taken in stage order, so each rank's
        partner in its next one is free by then (no cycle of waits)."""
        shapes = {s: example for s, example in zip(self.stage_ids, examples, strict=True)}
        total = 0.0
        for s in range(self.num_stages - 1):
            sender, receiver = self.stage_rank[s], self.stage_rank[s + 1]
            if sender == receiver or self.rank not in (sender, receiver):
                continue
            shape = shapes[s][1] if self.rank == sender else shapes[s + 1][0]
            message = torch.zeros(shape.shape, dtype=shape.dtype, device=self.device)
            peer = receiver if self.rank == sender else sender
            total += self.microbatches * self.one_way_seconds(message, peer, self.rank == sender)
        self.transfer_s_per_step = total

    def one_way_seconds(self, message: torch.Tensor, peer: int, leads: bool,
                        rounds: int = 10) -> float:
        """Half the shortest round trip of `message` between this rank and pipeline rank `peer`
        (after one unmeasured trip), as the leading side times it; the other side is sent the
        figure, so both use one value. The shortest: a trip on which either process waited for
        a core (a loaded host) measures the scheduler, not the link."""
        trips = []
        for _ in range(rounds + 1):
            start = self.clock.mark()
            if leads:
                dist.send(message, group=self.group, group_dst=peer)
                dist.recv(message, group=self.group, group_src=peer)
            else:
                dist.recv(message, group=self.group, group_src=peer)
                dist.send(message, group=self.group, group_dst=peer)
            trips.append((start, self.clock.mark()))
        figure = torch.zeros(1, dtype=torch.float64, device=self.device)
        if leads:
            figure[0] = min(self.clock.seconds(start, end) for start, end in trips[1:]) / 2
            dist.send(figure, group=self.group, group_dst=peer)
        else:
            dist.recv(figure, group=self.group, group_src=peer)
        return float(figure[0])

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Mark what runs within as the stage's compute (busy time): the loss of the last
        stage's micro-batch, which the schedules compute apart from the stage's forward."""
        start = self.clock.mark()
        try:
            yield
        finally:
            self.busy["forward"].append((start, self.clock.mark()))

    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits for a whole batch, passed stage to stage (any batch size, no micro-batches).

        Every rank returns the last stage's logits, as contiguous float32: the one dtype every
        rank can allocate for them without knowing what autocast made of the head (gloo fills a
        larger buffer with a shorter message without complaint, and sends a strided tensor's
        storage as it lies).
        """
        hidden = inputs
        for module, s in zip(self.modules, self.stage_ids, strict=True):
            if s > 0 and self.stage_rank[s - 1] != self.rank:  # else: this rank's last output
                hidden = self.receive(self.stage_rank[s - 1])
            hidden = module(hidden)
            if s < self.num_stages - 1 and self.stage_rank[s + 1] != self.rank:
                self.send(hidden, self.stage_rank[s + 1])
        # The shape first (a class per sample, or one per token): the other ranks allocate it.
        shape = torch.zeros(1 + MAX_DIMS, dtype=torch.long, device=self.device)
        if self.holds_last:
            logits = hidden.float().contiguous()  # a padded head's output is a strided slice
            shape[: 1 + logits.dim()] = torch.tensor([logits.dim(), *logits.shape])
        dist.broadcast(shape, src=self.last_rank, group=self.group)
        if not self.holds_last:
            dims = int(shape[0])
            logits = torch.empty(shape[1 : 1 + dims].tolist(), device=self.device)
        dist.broadcast(logits, src=self.last_rank, group=self.group)
        return logits

    def divide_gradients(self) -> None:
        """Divide the gradients accumulated over the optimizer step by the micro-batches of a
        schedule step, once (as torch's scale_grads does after every step): each micro-batch's
        loss is its mean, so the activations' gradients keep the size one step gives them."""
        for module in self.modules:
            for param in module.parameters():
                if param.grad is not None:
                    param.grad.div_(self.microbatches)

    def add_tied_gradients(self) -> None:
        """Give both copies of a weight the first and the last stage share (a language model's
        token embedding, also its output layer) the sum of their gradients, as one model's one
        weight gets: each copy then takes the same optimizer step and they stay equal.

        Both ends add in the same order (first stage's + last stage's), so the copies stay
        bitwise equal; only the two ranks holding them communicate.
        """
        first, last = 0, self.num_stages - 1
        stages = zip(self.stage_ids, self.modules, strict=True)
        held = {s: module for s, module in stages if s in (first, last)}
        for name in self.tied:
            grads = {s: local_gradient(module, name) for s, module in held.items()}
            if len(grads) == 2:  # both ends on this rank (one pipeline rank, or a V)
                grads[first].add_(grads[last])
                grads[last].copy_(grads[first])
            elif first in grads:
                self.send(grads[first], to=self.stage_rank[last])
                grads[first].add_(self.receive(self.stage_rank[last]))
            elif last in grads:
                own, theirs = grads[last], self.receive(self.stage_rank[first])
                self.send(own, to=self.stage_rank[first])
                own.copy_(theirs.add_(own))

    def send(self, tensor: torch.Tensor, to: int) -> None:
        """`tensor` to pipeline rank `to`, after its dtype and shape, so that `receive` allocates
        exactly what arrives."""
        dtype_index = ACTIVATION_DTYPES.index(tensor.dtype)
        header = torch.tensor([dtype_index, tensor.dim()], dtype=torch.long, device=self.device)
        shape = torch.tensor(tensor.shape, dtype=torch.long, device=self.device)
        tensor = tensor.contiguous()
        for part in (header, shape, tensor):
            dist.send(part, group=self.group, group_dst=to)
        if _stepping is self:
            self.sent_bytes += header.nbytes + shape.nbytes + tensor.nbytes

    def receive(self, source: int) -> torch.Tensor:
        """The tensor `send` sent from pipeline rank `source`, in its own dtype and shape."""
        header = torch.empty(2, dtype=torch.long, device=self.device)
        dist.recv(header, group=self.group, group_src=source)
        dtype_index, dims = header.tolist()
        shape = torch.empty(dims, dtype=torch.long, device=self.device)
        dist.recv(shape, group=self.group, group_src=source)
        tensor = torch.empty(
            shape.tolist(), dtype=ACTIVATION_DTYPES[dtype_index], device=self.device
        )
        dist.recv(tensor, group=self.group, group_src=source)
        return tensor

    def metrics(self) -> dict[str, float]:
        """The pipeline's figures since the last log point: each pipeline rank's peak memory,
        the most bytes a rank sent point to point per training step (`comm/bytes_per_step`:
        activations, their gradients and the tied weights' gradients, each send's bytes as they
        go on the wire), and the bubble.

        The bubble is the share of step time this rank's stages were not computing, mean over
        all ranks, in three parts: transfer (the time this rank's messages take once sent,
        measured by `time_transfers`, at most the time it waited on sends and receives),
        schedule (the rest of those waits: a peer still computing what this rank needs, the
        bubble a schedule's theory predicts) and overhead (idle time outside any wait: the
        schedule's own work between computes).

        Reads the marks since the last call: on CUDA the events are complete by now (the log
        point has waited for the device), so no micro-batch ever waited for one.
        """
        forward_s, backward_s, weight_s, step_s, wait_s = (
            sum(self.clock.seconds(start, end) for start, end in marks)
            for marks in (*self.busy.values(), self.steps, self.waits)
        )
        busy_s = forward_s + backward_s + weight_s
        steps = len(self.steps)
        transfer_s = min(self.transfer_s_per_step * steps, wait_s)
        sent = self.sent_bytes / steps if steps else 0.0
        self.sent_bytes = 0
        for marks in (*self.busy.values(), self.steps, self.waits):
            marks.clear()
        idle = 1 - busy_s / step_s if step_s else 0.0
        waited = min(wait_s / step_s, idle) if step_s else 0.0
        transfer = min(transfer_s / step_s, waited) if step_s else 0.0
        shares = torch.tensor([idle, waited, transfer, forward_s, backward_s, weight_s],
                              device=self.device, dtype=torch.float64)
        dist.all_reduce(shares)
        idle, waited, transfer = (shares[:3] / dist.get_world_size()).tolist()
        theory = self.theory_at(*shares[3:].tolist())
        # Each pipeline rank's peak in its own slot, the highest over data-parallel replicas.
        # Then the most bytes a rank sent per step (exact in float64 up to 2**53).
        peaks = torch.zeros(self.size + 1, dtype=torch.float64)  # CPU: gloo serves every group
        peaks[self.rank] = local_peak_bytes(self.device)
        peaks[-1] = sent
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        *peaks, sent = peaks.tolist()
        return {
            "pp/bubble_fraction": idle,
            "pp/bubble_transfer_fraction": transfer,
            "pp/bubble_schedule_fraction": waited - transfer,
            "pp/bubble_overhead_fraction": idle - waited,
            "pp/bubble_fraction_theory": theory,
            **{f"pp/peak_bytes_rank{r}": peak for r, peak in enumerate(peaks)},
            **({"comm/bytes_per_step": sent} if sent else {}),
        }

    def theory_at(self, forward_s: float, backward_s: float, weight_s: float) -> float:
        """The schedule's bubble share at this run's p, m and v. A zero-bubble schedule's
        depends on its passes' times, taken as measured (all ranks' forward, input-gradient and
        weight-gradient seconds; their ratios are what counts): (p - 1)(T_F + T_B - k T_W) over
        v m (T_F + T_B + T_W) plus that, per stage's micro-batch times."""
        if not self.weight_passes_in_bubble or not weight_s:
            return self.theory_bubble
        p, chunks = self.size, len(self.stage_ids) * self.microbatches
        bubble = (p - 1) * max(0.0, forward_s + backward_s
                               - self.weight_passes_in_bubble * weight_s)
        return bubble / (chunks * (forward_s + backward_s + weight_s) + bubble)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's full weights gathered over the pipeline, at the model's own sizes; keys
        as in the whole model.

        Padding is cut per stage: a stage's module paths are the whole model's names, while the
        list that holds the stages prefixes them with its index.
        """
        options = StateDictOptions(full_state_dict=True)
        mine = {
            name: value.cpu()
            for module in self.modules
            for name, value in unpad_state_dict(
                get_model_state_dict(module, options=options), module
            ).items()
        }
        parts: list[dict | None] = [None] * self.size
        dist.all_gather_object(parts, mine, group=self.group)
        return {name: value for part in parts for name, value in part.items()}

    def own_names(self, state: dict[str, Any], at: int) -> dict[str, Any]:
        """A state dict of this rank's stages keyed by the whole model's own names: the
        stage's index in the list that holds them, the `at`-th dotted part of each key, is
        dropped. So a checkpoint a pipeline writes loads under any layout, and a pipeline loads
        a checkpoint written under any layout (another strategy, another cut into stages)."""
        return {without_part(key, at): value for key, value in state.items()}

    def stage_names(
        self, state: dict[str, Any], template: dict[str, Any], at: int
    ) -> dict[str, Any]:
        """`state` (keyed as `own_names` gives) keyed again as `template`, a state dict of this
        rank's stages, to load into them.

        Where one rank holds both copies of a tied weight (a V schedule's first and last stage)
        both keys read one value: each gets a tensor of its own, since the optimizer keeps the
        tensors it loads, and two parameters sharing one momentum buffer would update it twice
        a step."""
        staged, used = {}, set()
        for key in template:
            value = state[without_part(key, at)]
            if isinstance(value, torch.Tensor) and id(value) in used:
                value = value.clone()
            used.add(id(value))
            staged[key] = value
        return staged


def like(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A meta tensor of `tensor`'s shape, strides and dtype (its metadata, no memory)."""
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    return meta.requires_grad_(requires_grad)


def without_part(key: str, at: int) -> str:
    """`key` (dotted) without its `at`-th part."""
    parts = key.split(".")
    return ".".join(parts[:at] + parts[at + 1:])


def local_gradient(module: nn.Module, name: str) -> torch.Tensor:
    """The gradient of `module`'s parameter `name` as this rank holds it (a shard under FSDP)."""
    grad = module.get_parameter(name).grad
    return grad.to_local() if isinstance(grad, DTensor) else grad
