"""Trainer: assembles the torch runtime on one rank from the resolved job, then trains it."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mgpu import fault
from mgpu.balance import Balance
from mgpu.checkpoint import Checkpointer, manifest, restart_count, step_dir
from mgpu.compression import CommHook, Compression
from mgpu.data.loader import EvalBatches
from mgpu.loss import IGNORED_LABEL, cross_entropy
from mgpu.meter import OtherLoad, StepMeter, peak_memory_bytes
from mgpu.monitor import Monitor
from mgpu.monitor.mfu import MFU
from mgpu.options import Options
from mgpu.parallel import parallelize
from mgpu.precision import Precision
from mgpu.runtime import Runtime
from mgpu.strategy import WIRE, Strategy
from mgpu.switch import Triggers
from mgpu.tracking import MetricLogger

if TYPE_CHECKING:
    from mgpu.job import EvalConf, FaultConf, Job, SwitchWhen, TrainConf

log = logging.getLogger("mgpu.trainer")


def replica_seed(seed: int, replica: int, step: int = 0) -> int:
    """The seed of data-parallel replica `replica` in a run seeded `seed`: each (seed, replica)
    pair its own stream, where seed + replica would give seed 1's replica 0 the masks of seed
    0's replica 1. A negative seed counts modulo 2**64, as torch.manual_seed reads it. A run
    resumed at `step` without its saved random states (another layout) starts another stream,
    so it does not draw the masks of the run's first steps again."""
    entropy = [seed % 2**64, replica, *([step] if step else [])]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def switch_metrics(job: Job, step: int) -> dict[str, float]:
    """What the switch at `step` cost: wall time from the start of its save to the resumed
    state (`switch/seconds`) and the checkpoint's bytes on disk (`switch/bytes`; 0 where an
    out-of-memory switch found no checkpoint and starts over)."""
    saved = manifest(step_dir(Path(job.checkpoint.dir), step)) if step else {"files": {}}
    return {"switch/at_step": step, "switch/seconds": time.time() - job.switch.started_at,
            "switch/bytes": sum(f["bytes"] for f in saved["files"].values())}


def one_comm_hook(*hooks: CommHook | None) -> CommHook | None:
    """The comm hook the options hand over, or None (DDP's built-in all-reduce).

    DDP takes one hook; `mgpu.support` refuses a run in which two options each own one, so two
    here are a bug, said so rather than one silently replacing the other."""
    owned = [hook for hook in hooks if hook is not None]
    if len(owned) > 1:
        raise RuntimeError(f"{len(owned)} options each hand over DDP's one comm hook")
    return owned[0] if owned else None


@dataclass
class Trainer:
    train_cfg: TrainConf
    eval_cfg: EvalConf
    fault_cfg: FaultConf
    global_batch: int
    runtime: Runtime
    model: nn.Module
    precision: Precision
    strategy: Strategy
    compression: Compression
    balance: Balance
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    val_loader: EvalBatches
    tracker: MetricLogger | None
    monitor: Monitor
    checkpointer: Checkpointer
    start_step: int = 0  # the step of the checkpoint this run resumed from
    switch_at: int = 0  # the step after which the run stops to switch strategy (0: never)
    switch_when: SwitchWhen | None = None  # the triggers of a switch still to come
    switched: dict[str, float] = field(default_factory=dict)  # what a switch before it cost

    @classmethod
    def build(
        cls, job: Job, runtime: Runtime, run_id: str | None, options: Options | None = None
    ) -> Trainer:
        """Data → model → precision → the strategy's plan → its mesh → the model laid out by
        it → compression and balance → DDP's comm hook → optimizer → tracking → checkpointer,
        then the state of the checkpoint to resume from, if any.

        `options` are the job's options as the process built them once (`start_task`); a
        test or script that starts here gets them built from `job`."""
        options = options or Options.of(job.groups())
        torch.manual_seed(job.seed)  # same initial weights on every rank
        data, precision, strategy = options.data, options.precision, options.strategy
        train_set, val_set = data.splits(job.seed)
        model = options.model(input_shape=data.input_shape, num_classes=data.num_classes)
        model = precision.prepare(model)
        plan = strategy.plan(runtime.world_size)
        mesh = plan.device_mesh(runtime.device)  # the one mesh: every step below slices it
        # Pipeline split, then on each stage TP → activation checkpointing → FSDP2 or DDP.
        layout = parallelize(model, plan, mesh, runtime.device, precision, options.network,
                             options.compression.wire_dtype)
        strategy.use(layout)  # the step, evaluation and export run on this layout
        model = layout.model
        precision.attach(model, runtime.device)
        # Ranks sharing one model replica read the same data.
        data_runtime = layout.data_runtime(runtime)
        # From here on each replica draws its own dropout masks; ranks that share a replica (its
        # tp and pp peers) keep drawing alike, as their replicated activations need.
        torch.manual_seed(replica_seed(job.seed, data_runtime.rank))
        compression, balance = options.compression, options.balance
        mfu = None
        if job.monitor.enabled:
            mfu = MFU.for_run(options.model, data, runtime.device, precision, runtime.world_size)
        monitor = Monitor(job.monitor, runtime, run_id, job.tracking.uri,
                          job.train.warmup_steps, mfu)
        balance.attach(model, data_runtime, data.batch_size, job.train.grad_accum,
                       job.straggler, job.seed)
        # DDP takes one comm hook: at most one option owns it (a compression other than none,
        # or balance=ssp; where both have one, ssp's hook carries the compression's: sends in
        # its wire dtype or runs its hook). It is registered here and nowhere else, timed where
        # the monitor times communication (only a DDP model takes a hook).
        compression_hook = compression.comm_hook(model)
        balance_hook = balance.comm_hook(model, compression, compression_hook)
        if balance_hook is not None and balance.carries_compression:
            compression_hook = None  # the balance's hook carries it
        hook = one_comm_hook(compression_hook, balance_hook)
        if isinstance(model, DistributedDataParallel):
            hook = monitor.timed(hook)
        if hook is not None:
            model.register_comm_hook(*hook)
        optimizer, scheduler = strategy.build_optimizer(options.optim, model, job.train.steps)
        tracker = None
        if runtime.is_main and run_id:
            tracker = MetricLogger(job.tracking.uri, run_id, job.output_dir)
        trainer = cls(
            train_cfg=job.train,
            eval_cfg=job.eval,
            fault_cfg=job.fault,
            global_batch=data.batch_size,
            runtime=runtime,
            model=model,
            precision=precision,
            strategy=strategy,
            compression=compression,
            balance=balance,
            optimizer=optimizer,
            scheduler=scheduler,
            batches=balance.batches(train_set),
            val_loader=EvalBatches(val_set, job.eval.batch_size, data_runtime),
            tracker=tracker,
            monitor=monitor,
            checkpointer=Checkpointer(job.checkpoint, job.resume, runtime, run_id,
                                      switched=job.switch.switched),
            switch_at=job.switch.when.at_step if job.switch.to is not None else 0,
            switch_when=job.switch.when if job.switch.to is not None else None,
        )
        if strategy.steps_optimizer:  # a no-flush pipeline steps each batch's update itself
            strategy.hand_optimizer_step(trainer.optimizer_step)
        trainer.start_step = trainer.checkpointer.restore(trainer)
        if trainer.start_step and not trainer.checkpointer.rng_restored:
            torch.manual_seed(replica_seed(job.seed, data_runtime.rank, trainer.start_step))
        if trainer.start_step:
            trainer.log({"checkpoint/resumed_from_step": trainer.start_step}, trainer.start_step)
        if job.switch.started_at:  # the run after a switch, resumed from its checkpoint
            trainer.switched = switch_metrics(job, trainer.start_step)
            trainer.log(trainer.switched, trainer.start_step)
        return trainer

    def train(self) -> dict[str, float]:
        """The loop: step, record, and on schedule log metrics and evaluate. Returns the summary.

        Log points, evaluation and checkpoints run as stalls of the meter: they are timed on
        their own and left out of the step figures."""
        cfg = self.train_cfg
        steps, log_every = cfg.steps, cfg.log_every
        eval_every = self.eval_cfg.every_steps
        # The machine's contention is measured where its figures are logged: rank 0.
        other_load = OtherLoad() if self.runtime.is_main else None
        meter = StepMeter(self.global_batch, cfg.warmup_steps, self.runtime.device, other_load)
        failure = fault.this_attempt(self.fault_cfg, steps, self.checkpointer.every,
                                     self.runtime.world_size, self.runtime.rank)
        restarts = restart_count()
        log.info("training %d steps on %d rank(s), %s", steps, self.runtime.world_size,
                 self.runtime.device)
        metrics: dict[str, float] = {}
        if 0 < self.switch_at <= self.start_step:  # switched already: the new strategy goes on
            return {"step": self.start_step, "switch/started_at": time.time()}
        triggers = self.switch_when and Triggers(self.switch_when, self.start_step,
                                                 self.global_batch)
        step_mark = fault.naming_step(self.runtime.output_dir, self.runtime.rank)
        with self.progress_bar() as bar, step_mark as at:
            task = bar.add_task("train", total=steps, completed=self.start_step, loss="-", rate="-")
            for step in range(self.start_step + 1, steps + 1):
                at.step = step
                if failure and step == failure.step and failure.mode != fault.IN_CHECKPOINT:
                    fault.inject(failure.mode, self.runtime.rank, step, self.model)
                loss_sum, samples = self.train_step()
                meter.record(step, loss_sum, samples)
                if restarts and step == self.start_step + 1:  # where a restart's recovery ends
                    log.info("step %d done, the first after restart %d", step, restarts)
                self.monitor.end_step(step, samples)
                at.completed(step)
                membership = self.runtime.membership
                if membership and step == self.start_step + 1:  # this group's first step
                    self.log(membership.metrics(self.start_step, time.time()), step)
                switch = step == self.switch_at
                if step % log_every == 0 or step == steps:
                    with meter.stall():
                        metrics, step_s = self.log_point(step, meter)
                        rate = metrics.get("train/samples_per_s", 0)
                        bar.update(task, completed=step, loss=f"{metrics['train/loss']:.4f}",
                                   rate=f"{rate:,.0f}")
                        if triggers and step < steps:
                            switch |= triggers.fires(step, metrics["train/loss"], step_s)
                if eval_every and step % eval_every == 0 and step < steps:
                    with meter.stall() as stall:
                        self.strategy.drain()
                        results = self.evaluate()
                    self.log({**results, "time/eval_s": stall.seconds}, step)
                if switch:
                    return self.stop_for_switch(step, metrics)
                if self.checkpointer.due(step):
                    with meter.stall():
                        self.strategy.drain()
                        writer = fault.checkpoint_writer(failure, step)
                        self.log(self.checkpointer.save(self, step, writer), step)
        self.checkpointer.wait()
        self.strategy.drain()
        final_eval = self.evaluate()
        self.log(final_eval, steps)
        return {**metrics, **final_eval, **self.checkpointer.summary(), **self.switched,
                "step": steps}

    def stop_for_switch(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """End this strategy's part of the run at `step`: its checkpoint, which the next
        strategy resumes from (`mgpu.launch`), written and committed; no final evaluation."""
        started = time.time()
        self.checkpointer.switched = True  # a re-run resumes this one with the new strategy
        self.strategy.drain()
        self.log(self.checkpointer.save(self, step), step)
        self.checkpointer.wait()
        return {**metrics, "step": step, "switch/started_at": started}

    def train_step(self) -> tuple[torch.Tensor, int]:
        """One optimizer step over `grad_accum` micro-batches.

        Returns this rank's loss summed over its samples (detached, on the device) and the
        number of samples: under an uneven split the ranks' losses weigh by their samples.
        """
        accum = self.train_cfg.grad_accum
        timer = self.monitor.timer
        loss_sum, samples = None, 0
        with self.strategy.counting():  # tp's collectives, on the first step
            grad_scale = self.precision.grad_scale()
            self.balance.before_step()
            self.compression.begin_step(grad_scale)
            for micro in range(accum):
                with timer.phase("data"):
                    inputs, labels = next(self.batches)
                last = micro == accum - 1
                with nullcontext() if last else self.strategy.no_sync(self.model):
                    # Weighted by the micro-batch's share of the global batch (= accum if equal).
                    divisor = self.balance.loss_divisor(len(labels))
                    loss = self.strategy.forward_backward(
                        self.model, inputs, labels, self.precision, divisor, timer
                    )
                weighted = loss * len(labels)
                loss_sum = weighted if loss_sum is None else loss_sum + weighted
                samples += len(labels)
            self.balance.after_backward()
            if not self.strategy.steps_optimizer:
                self.optimizer_step()
        return loss_sum, samples

    def optimizer_step(self) -> None:
        """Apply the gradients: the end of `train_step`, or where a layout that steps the
        optimizer itself calls it (a no-flush pipeline, once a batch's gradients are complete)."""
        with self.monitor.timer.phase("optimizer"):
            carried = self.balance.carried_scale(self.precision.grad_scale())
            applied = self.balance.has_gradients() and self.precision.step(self.optimizer, carried)
            self.compression.end_step(applied)
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()

    def log_point(self, step: int, meter: StepMeter) -> tuple[dict[str, float], float]:
        """Metrics since the last log point: loss over all ranks, throughput, memory, bytes on
        the wire, and how long this log point held up training (`time/log_point_s`); with the
        mean step time of those steps on this rank, stalls left out."""
        started = time.perf_counter()
        step_s = meter.window_step_s()
        strategy = self.strategy.metrics(self.model, self.optimizer)
        compression = self.compression.metrics()
        metrics = {
            "train/loss": meter.window_loss(),
            "train/lr": self.scheduler.get_last_lr()[0],
            "memory/peak_bytes": float(peak_memory_bytes(self.runtime.device)),
            **strategy,
            **meter.throughput(),
            **self.precision.metrics(),
            **self.balance.metrics(),
            **compression,  # the gradients' bytes on the wire, which the monitor times
        }
        if WIRE in strategy and WIRE in compression:  # a pipeline's or tp's beside FSDP2's
            metrics[WIRE] = strategy[WIRE] + compression[WIRE]
        metrics.update(self.monitor.log_point(step, metrics, step_s))
        metrics["time/log_point_s"] = time.perf_counter() - started
        log.info(
            "step %d  loss %.4f  %s samples/s",
            step, metrics["train/loss"], f"{metrics.get('train/samples_per_s', 0):,.0f}",
        )
        self.log(metrics, step)
        return metrics, step_s or 0.0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the held-out split, summed over all ranks' disjoint slices:
        per sample for a classifier, per token for a language model (nats per token, next-token
        accuracy), with what the held-out set adds (its perplexity and unigram baseline).

        Samples labelled IGNORED_LABEL only keep a rank's forward passes in step with its peers'.
        """
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.runtime.device)
        for inputs, labels in self.val_loader:
            inputs, labels = inputs.to(self.runtime.device), labels.to(self.runtime.device)
            with self.precision.autocast(self.runtime.device):
                logits = self.strategy.predict(self.model, inputs)
            totals[0] += cross_entropy(logits.float(), labels, reduction="sum")
            totals[1] += (logits.argmax(dim=-1) == labels).sum()
            totals[2] += (labels != IGNORED_LABEL).sum()
        if dist.is_initialized():
            dist.all_reduce(totals)
        self.model.train()
        loss, correct, count = totals.tolist()
        log.info("eval  loss %.4f  accuracy %.4f", loss / count, correct / count)
        return {"eval/loss": loss / count, "eval/accuracy": correct / count,
                **self.val_loader.eval_metrics(loss / count)}

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker:
            self.tracker.log(metrics, step)

    def save_weights(self) -> None:
        """Full (unsharded) weights in `model.pt`, written by rank 0; every rank must call it.

        At the model's own sizes, as the strategy gathers them: tensor-core padding is how this
        run stored them, not part of the model.
        """
        state = self.strategy.full_state_dict(self.model)
        if self.runtime.is_main:
            torch.save(state, self.runtime.output_dir / "model.pt")

    def close(self) -> None:
        self.monitor.close()
        self.checkpointer.close()
        if self.tracker:
            self.tracker.close()

    def progress_bar(self) -> Progress:
        """A rich progress bar, shown by rank 0 in a terminal (elsewhere log lines suffice)."""
        return Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[rate]} samples/s"),
            TimeRemainingColumn(),
            disable=not (self.runtime.is_main and sys.stdout.isatty()),
        )
