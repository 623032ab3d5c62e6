"""Pipelines outside the training step: what crosses a stage boundary keeps its dtype, every rank
evaluates with the last stage's logits, and the saved weights are the model's own."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mgpu.job import Job
from mgpu.model.cnn import CNN
from mgpu.model.gpt import GPT
from mgpu.options import build
from mgpu.pipeline import Pipeline
from mgpu.runtime import init_runtime, shutdown
from tests.conftest import launch_job, launch_ranks, make_job
from tests.test_strategies import GPT as NARROW_GPT

pytestmark = pytest.mark.timeout(600)
# A few steps suffice: these tests check evaluation and export, not training.
SHORT = [*NARROW_GPT, "train.steps=10", "train.log_every=5"]


def narrow_gpt() -> GPT:
    """The model NARROW_GPT configures, built the same way on every rank (seed 0)."""
    torch.manual_seed(0)
    return GPT((1, 8, 8), 10, dim=32, mlp_ratio=2)


def inputs_and_activation() -> tuple[torch.Tensor, torch.Tensor]:
    """Images to predict and a bf16 activation to send, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    images = torch.rand(6, 1, 8, 8, generator=gen)
    return images, torch.randn(3, 4, 5, generator=gen).to(torch.bfloat16)


def exchange_on_two_stages(output_dir: str) -> dict[str, torch.Tensor | None]:
    """On each of 2 ranks: a 2-stage pipeline predicts under bf16 autocast, then rank 0 sends a
    bf16 activation to rank 1."""
    runtime = init_runtime(output_dir, 60)
    try:
        pipe = Pipeline(narrow_gpt(), dist.group.WORLD, runtime.device, "gpipe", 2, lambda s: s)
        images, activation = inputs_and_activation()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = pipe.predict(images)
        received = None
        if runtime.rank == 0:
            pipe.send(activation, to=1)
        else:
            received = pipe.receive(0)
        return {"logits": logits, "received": received}
    finally:
        shutdown()


@pytest.mark.dist
def test_bf16_crosses_stages_intact_and_every_rank_gets_the_last_stage_logits(tmp_path):
    results = launch_ranks(exchange_on_two_stages, 2, "pipeline", str(tmp_path))
    images, activation = inputs_and_activation()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = narrow_gpt()(images).float()
    received = results[1]["received"]
    assert received.dtype == torch.bfloat16 and torch.equal(received, activation)
    for rank in (0, 1):
        logits = results[rank]["logits"]
        assert logits.dtype == torch.float32, rank
        torch.testing.assert_close(logits, whole, rtol=0, atol=0, msg=f"rank {rank}")


def evaluate_alone(job: Job, weights: dict[str, torch.Tensor], bf16: bool) -> dict[str, float]:
    """`weights` loaded strictly into the job's unpadded model, evaluated by one process on the
    whole held-out set in the run's eval batches."""
    data = build(job.data)
    _, val_set = data.splits(job.seed)
    model = build(job.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model.load_state_dict(weights, strict=True)
    model.eval()
    loss = correct = 0.0
    batches = torch.utils.data.DataLoader(val_set, batch_size=job.eval.batch_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for images, labels in batches:
            logits = model(images)
            loss += F.cross_entropy(logits.float(), labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
    return {"eval/loss": loss / len(val_set), "eval/accuracy": correct / len(val_set)}


def launch_and_evaluate_alone(overrides: list[str], out: Path, bf16: bool) -> tuple[dict, dict]:
    summary, weights = launch_job(overrides, out)
    return summary, evaluate_alone(make_job(overrides, out), weights, bf16)


@pytest.mark.dist
def test_pipeline_eval_under_bf16_is_one_process_eval_of_its_weights(tmp_path):
    """Every rank scores the last stage's logits: the run's eval equals one process's."""
    summary, alone = launch_and_evaluate_alone(
        [*SHORT, "strategy=pp", "precision=bf16"], tmp_path, bf16=True
    )
    assert summary["eval/accuracy"] == alone["eval/accuracy"]
    assert summary["eval/loss"] == pytest.approx(alone["eval/loss"], rel=1e-9)


@pytest.mark.dist
@pytest.mark.parametrize(
    "strategy",
    [["strategy=pp"], ["strategy=hybrid", "strategy.pp=2"]],
    ids=["pp", "hybrid-pp"],
)
def test_pipeline_saves_padded_weights_at_the_model_sizes(tmp_path, strategy):
    """The GPT head's 10 outputs are stored padded to 16; model.pt holds the real sizes and
    loads into the unpadded model, which computes what the trained model did."""
    summary, alone = launch_and_evaluate_alone(
        [*SHORT, *strategy, "precision.pad_to_multiple_of=8"], tmp_path, bf16=False
    )
    assert summary["eval/accuracy"] == alone["eval/accuracy"]
    assert summary["eval/loss"] == pytest.approx(alone["eval/loss"], rel=1e-5)


def language_model() -> GPT:
    """A two-block language model whose token embedding is also its output layer (tied across
    the first and the last stage), built the same way on every rank (seed 0)."""
    torch.manual_seed(0)
    return GPT((8,), 16, dim=16, heads=2, layers=2, mlp_ratio=2)


def accumulated_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro-batches of token sequences and their labels, the same on every rank."""
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(16, (2, 4, 8), generator=gen)
    labels = torch.randint(16, (2, 4, 8), generator=gen)
    return list(zip(tokens, labels, strict=True))


def accumulate_on_two_stages(output_dir: str) -> dict[str, torch.Tensor]:
    """On each of 2 ranks: two schedule steps of 2 micro-batches each accumulate one optimizer
    step's gradients (the first inside `accumulating`, as the trainer's no_sync has it);
    returns this rank's stage's gradients by the whole model's names."""
    runtime = init_runtime(output_dir, 60)
    try:
        pipe = Pipeline(language_model(), dist.group.WORLD, runtime.device, "1f1b", 2,
                        lambda s: s)
        (first_in, first_labels), (second_in, second_labels) = accumulated_batches()
        with pipe.accumulating():
            pipe.forward_backward(first_in, first_labels, None, 2)
        pipe.forward_backward(second_in, second_labels, None, 2)
        [stage] = pipe.modules
        return {name: p.grad.clone() for name, p in stage.named_parameters()}
    finally:
        shutdown()


@pytest.mark.dist
def test_accumulated_pipeline_steps_give_the_mean_gradient_of_all_their_pieces(tmp_path):
    """grad_accum=2 over a 2-micro-batch pipeline: the gradient is one model's mean over the 4
    pieces, the tied embedding's on both stages too (summed once, not once per step)."""
    results = launch_ranks(accumulate_on_two_stages, 2, "accumulate", str(tmp_path))
    model = language_model()
    for tokens, labels in accumulated_batches():
        for x, y in zip(tokens.tensor_split(2), labels.tensor_split(2), strict=True):
            logits = model(x)
            (F.cross_entropy(logits.flatten(0, -2), y.flatten()) / 4).backward()
    whole = dict(model.named_parameters())
    assert "tok_emb.weight" in results[0] and "tok_emb.weight" in results[1]
    for rank in (0, 1):
        for name, grad in results[rank].items():
            torch.testing.assert_close(grad, whole[name].grad, rtol=1e-5, atol=1e-7,
                                       msg=f"rank {rank}: {name}")


def small_cnn() -> CNN:
    """Two conv blocks with BatchNorm, built the same way on every rank (seed 0)."""
    torch.manual_seed(0)
    return CNN((1, 8, 8), 10, channels=[4, 6], hidden=8)


def images_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(8, 1, 8, 8, generator=gen) * 2 + 1, torch.randint(10, (8,), generator=gen)


def step_cnn_on_two_stages(output_dir: str) -> dict[str, torch.Tensor]:
    """On each of 2 ranks: one 1F1B step of 4 micro-batches through a 2-stage CNN; returns
    this rank's stage's buffers (BatchNorm's running statistics) by the whole model's names."""
    runtime = init_runtime(output_dir, 60)
    try:
        pipe = Pipeline(small_cnn(), dist.group.WORLD, runtime.device, "1f1b", 4, lambda s: s)
        pipe.forward_backward(*images_and_labels())
        [stage] = pipe.modules
        return {name: b.clone() for name, b in stage.named_buffers()}
    finally:
        shutdown()


@pytest.mark.dist
def test_pipeline_batchnorm_statistics_count_each_micro_batch_once(tmp_path):
    """A CNN's BatchNorm running statistics after one pipeline step are one model's after a
    training forward of each micro-batch in turn: no stage ran an extra forward (torch's shape
    inference runs one, on a real micro-batch at the first stage and on uninitialised memory
    at the others, unless the stages are given their shapes)."""
    results = launch_ranks(step_cnn_on_two_stages, 2, "batchnorm", str(tmp_path))
    model = small_cnn()
    images, _ = images_and_labels()
    for piece in images.tensor_split(4):
        model(piece)
    whole = dict(model.named_buffers())
    assert "convs.0.1.running_mean" in results[0] and "convs.1.1.running_mean" in results[1]
    for rank in (0, 1):
        for name, buffer in results[rank].items():
            torch.testing.assert_close(buffer, whole[name], rtol=1e-6, atol=1e-7,
                                       msg=f"rank {rank}: {name}")


#: PipeDream-2BW's test: steps, and an lr large enough that one step of staleness shows.
STALE_STEPS, STALE_LR = 4, 0.5


def stale_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch of 4 token sequences and their labels per step, the same on every rank."""
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(16, (STALE_STEPS, 4, 8), generator=gen)
    labels = torch.randint(16, (STALE_STEPS, 4, 8), generator=gen)
    return list(zip(tokens, labels, strict=True))


def train_2bw_on_two_stages(output_dir: str) -> dict:
    """On each of 2 ranks: STALE_STEPS steps of schedule 2bw (2 micro-batches each), each rank's
    own stage's SGD with momentum handed to the pipeline, which steps it, then a drain; returns
    this rank's stage's weights by the whole model's names, and after each step the
    micro-batches it had in flight and the updates it had applied."""
    runtime = init_runtime(output_dir, 60)
    try:
        pipe = Pipeline(language_model(), dist.group.WORLD, runtime.device, "2bw", 2,
                        lambda s: s)
        [stage] = pipe.modules
        optimizer = torch.optim.SGD(stage.parameters(), lr=STALE_LR, momentum=0.9)
        updates = []

        def update() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            updates.append(len(updates) + 1)

        pipe.no_flush.update = update
        in_flight, applied = [], []
        for tokens, labels in stale_batches():
            pipe.forward_backward(tokens, labels)
            in_flight.append(len(pipe.no_flush.in_flight))
            applied.append(len(updates))
        pipe.drain()
        weights = {name: p.detach().clone() for name, p in stage.named_parameters()}
        return {"weights": weights, "in_flight": in_flight, "applied": applied,
                "drained": (len(pipe.no_flush.in_flight), len(updates))}
    finally:
        shutdown()


def one_process_weights(delay: int) -> dict[str, torch.Tensor]:
    """One process, from the definitions: each step's gradient (the mean over its 2
    micro-batches) taken at the weights of `delay` steps before, W(t+1) = W(t) - lr·g(W(t -
    delay)) with SGD's momentum, the weights before the first step standing for earlier ones."""
    model = language_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=STALE_LR, momentum=0.9)
    versions = [copy.deepcopy(model)] * (delay + 1)  # W(t - delay) .. W(t)
    for tokens, labels in stale_batches():
        at = versions[0]
        at.zero_grad(set_to_none=True)
        for x, y in zip(tokens.tensor_split(2), labels.tensor_split(2), strict=True):
            (F.cross_entropy(at(x).flatten(0, -2), y.flatten()) / 2).backward()
        for param, taken in zip(model.parameters(), at.parameters(), strict=True):
            param.grad = taken.grad.clone()
        optimizer.step()
        versions = [*versions[1:], copy.deepcopy(model)]
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.dist
def test_2bw_applies_each_step_the_gradient_of_the_weights_one_step_older(tmp_path):
    """PipeDream-2BW's update, W(t+1) = W(t) - lr·∇f(W(t-1)), on 2 stages: every weight of
    both ranks (the tied embedding's two copies too) is one process's applying that rule, and
    far from the synchronous update's (so the test tells the two apart)."""
    results = launch_ranks(train_2bw_on_two_stages, 2, "stale", str(tmp_path))
    weights = {rank: results[rank]["weights"] for rank in (0, 1)}
    stale, synchronous = one_process_weights(delay=1), one_process_weights(delay=0)
    assert "tok_emb.weight" in weights[0] and "tok_emb.weight" in weights[1]
    for rank in (0, 1):
        for name, weight in weights[rank].items():
            torch.testing.assert_close(weight, stale[name], rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank}: {name}")
    off = max(float((weights[rank][name] - synchronous[name]).abs().max())
              for rank in (0, 1) for name in weights[rank])
    assert off > 1e-3, off


@pytest.mark.dist
def test_2bw_keeps_micro_batches_in_flight_across_steps_and_drains_on_demand(tmp_path):
    """No flush: after every step the first of 2 stages still holds 1 micro-batch whose
    backward is to come (1F1B's warmup of p - 1 - rank), the last none; each rank applies a
    step's update at the end of the next step (none after the first), and a drain runs what is
    in flight and applies the last update."""
    results = launch_ranks(train_2bw_on_two_stages, 2, "in_flight", str(tmp_path))
    steps = len(stale_batches())
    for rank, ahead in ((0, 1), (1, 0)):
        assert results[rank]["in_flight"] == [ahead] * steps, rank
        assert results[rank]["applied"] == list(range(steps)), rank
        assert results[rank]["drained"] == (0, steps), rank
