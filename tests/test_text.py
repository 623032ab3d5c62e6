"""data=text: the standard library's sources as byte windows, and model=gpt as a language model
on them under every kind of parallelism, checked against one process."""

from __future__ import annotations

import math
import platform

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode

from mgpu.data.loader import TrainBatches
from mgpu.data.text import Text, corpus, held_out, source_files, stdlib_root
from mgpu.loss import cross_entropy
from mgpu.model.gpt import GPT
from tests.conftest import mlflow_runs
from tests.test_balance import cpu_runtime
from tests.test_ddp import SGD, assert_weights_close

SEQ_LEN = 16


def test_split_is_by_whole_files_and_fixed(tmp_path):
    root = stdlib_root()
    files = source_files(root)
    val = {p for p in files if held_out(p, root, 0.1, split_seed=0)}
    assert 0 < len(val) < len(files) / 5
    other_seed = {p for p in files if held_out(p, root, 0.1, split_seed=1)}
    assert other_seed != val
    train_bytes, val_bytes = corpus(root, 0.1, 0)
    assert len(val_bytes) == sum(p.stat().st_size for p in val)
    assert len(train_bytes) + len(val_bytes) == sum(p.stat().st_size for p in files)
    # The run's seed does not move the split: every run evaluates on the same windows.
    (train_a, val_a), (train_b, val_b) = Text(seq_len=SEQ_LEN).splits(0), Text(
        seq_len=SEQ_LEN).splits(7)
    assert torch.equal(val_a.starts, val_b.starts) and torch.equal(val_a.tokens, val_b.tokens)
    assert len(train_a) == len(train_b) == (len(train_bytes) - 1) // SEQ_LEN


def test_targets_are_the_inputs_shifted_by_one():
    train, val = Text(seq_len=SEQ_LEN, val_samples=8).splits(0)
    assert len(val) == 8
    for dataset in (train, val):
        for index in (0, 1, len(dataset) - 1):
            inputs, targets = dataset[index]
            assert inputs.shape == targets.shape == (SEQ_LEN,)
            assert inputs.dtype == targets.dtype == torch.long
            assert torch.equal(inputs[1:], targets[:-1])
            start = int(dataset.starts[index])
            assert int(targets[-1]) == int(dataset.tokens[start + SEQ_LEN])
    # Consecutive training windows tile the bytes: the next input starts at the last target.
    assert torch.equal(train[1][0][:1], train[0][1][-1:])
    # A batch cut at once is the samples stacked, as a DataLoader would give them.
    indices = torch.tensor([5, 0, len(train) - 1, 5])
    for cut, stacked in zip(train.batch(indices), default_collate([train[int(i)] for i in indices]),
                            strict=True):
        assert cut.dtype == stacked.dtype and torch.equal(cut, stacked)


def test_position_resumes_where_it_was_saved(tmp_path):
    train, _ = Text(seq_len=SEQ_LEN).splits(0)

    def batches() -> TrainBatches:
        return TrainBatches(train, [4, 4], 1, cpu_runtime(1, 2, tmp_path), seed=3)

    run = batches()
    for _ in range(5):
        next(run)
    saved = run.state_dict()
    expected = [next(run) for _ in range(3)]
    resumed = batches()
    resumed.load_state_dict(saved)
    for (inputs, targets), (again, again_targets) in zip(expected, (next(resumed) for _ in
                                                                     range(3)), strict=True):
        assert torch.equal(inputs, again) and torch.equal(targets, again_targets)
    assert saved == {"epoch": 0, "position": 5 * 8}


def test_unigram_baseline_and_run_params():
    train_bytes, _ = corpus(stdlib_root(), 0.1, 0)
    _, val = Text(seq_len=SEQ_LEN, val_samples=64).splits(0)
    # The baseline is the loss of predicting every target from the training byte frequencies.
    frequencies = (torch.bincount(train_bytes.long(), minlength=256) + 1).double()
    targets = torch.cat([val[i][1] for i in range(len(val))])
    expected = -(frequencies / frequencies.sum()).log()[targets].mean().item()
    metrics = val.eval_metrics(2.0)
    assert metrics["eval/unigram_entropy"] == pytest.approx(expected, rel=1e-12)
    assert 2.5 < metrics["eval/unigram_entropy"] < math.log(256)
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(2.0))
    params = Text().run_params()
    assert params["data.python_version"] == platform.python_version()
    assert int(params["data.train_bytes"]) == len(train_bytes)
    assert int(params["data.corpus_bytes"]) > 1_000_000


def test_gpt_reads_bytes_causally_and_ties_its_output_to_the_embedding():
    torch.manual_seed(0)
    model = GPT((SEQ_LEN,), 256, dim=32, heads=4, layers=2)
    tokens = torch.randint(0, 256, (2, SEQ_LEN))
    logits = model(tokens)
    assert logits.shape == (2, SEQ_LEN, 256)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    after = model(changed)
    torch.testing.assert_close(after[:, :10], logits[:, :10], rtol=0, atol=0)  # no peeking
    assert not torch.equal(after[:, 10], logits[:, 10])
    assert "head.weight" not in model.state_dict()


@pytest.mark.parametrize(("input_shape", "classes"), [((SEQ_LEN,), 256), ((1, 8, 8), 10)],
                         ids=["text", "image"])
def test_gpt_states_the_flops_torch_counts(input_shape, classes):
    """The model's training FLOPs per sample against torch's `FlopCounterMode` over a real
    forward and backward (2 FLOPs per multiply-add). Attention runs on the math kernel, whose
    matmuls torch counts (the fused CPU kernel it does not), so the count covers the scores
    and the weighted sum too, the causal mask's skipped half included. An image's pixels need
    no gradient: its patch embedding has none to pass back."""
    torch.manual_seed(0)
    model = GPT(input_shape, classes, dim=32, heads=4, layers=2)
    if model.next_token:
        tokens = torch.randint(0, classes, (2, SEQ_LEN + 1))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
    else:
        inputs, targets = torch.rand(2, *input_shape), torch.randint(0, classes, (2,))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        cross_entropy(model(inputs), targets).backward()
    assert counter.get_flop_counts()["Global"][torch.ops.aten.bmm] > 0  # attention counted
    assert model.flops_per_sample() == counter.get_total_flops() / 2


# ---- training: every parallel layout against one process ------------------------------------

# SGD (see tests/test_ddp.py), a narrow GPT, 16-byte windows: each launch takes a few seconds.
TEXT = [*SGD, "train.steps=10", "train.log_every=5", "model=gpt", "model.dim=32",
        "model.mlp_ratio=2", "data=text", f"data.seq_len={SEQ_LEN}", "data.val_samples=64"]
LAYOUTS = [
    ["strategy=ddp"],
    ["strategy=tp", "strategy.sequence_parallel=true"],
    ["strategy=pp"],  # the tied embedding on the first stage, its copy on the last
    # 4 stages on 2 ranks: the tied embedding's two copies on different ranks, FSDP2 on each.
    ["strategy=hybrid", "strategy.pp=2", "strategy.schedule=interleaved_1f1b"],
]


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("overrides", LAYOUTS, ids=[" ".join(o) for o in LAYOUTS])
def test_text_trains_as_one_process_does(launched_once, overrides):
    single, single_w = launched_once(*TEXT, "strategy=single")
    summary, weights = launched_once(*TEXT, *overrides)
    assert_weights_close(weights, single_w, atol=1e-5)
    assert summary["train/loss"] == pytest.approx(single["train/loss"], abs=1e-5)
    assert summary["eval/loss"] == pytest.approx(single["eval/loss"], abs=1e-5)
    assert summary["eval/accuracy"] == single["eval/accuracy"]
    assert summary["eval/unigram_entropy"] == single["eval/unigram_entropy"]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_gpt_on_text_beats_the_unigram_baseline(cli, tmp_path):
    """The CLI's text run: the held-out loss ends below what byte frequencies alone give, and
    the run records the corpus it read."""
    result = cli("model=gpt", "data=text", "train.steps=150", "eval.every_steps=0",
                 "checkpoint.every_steps=0")
    assert result.returncode == 0, result.stderr
    [run] = mlflow_runs(tmp_path)
    metrics, params = run.data.metrics, run.data.params
    assert metrics["eval/loss"] < metrics["eval/unigram_entropy"] - 0.3, metrics
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(metrics["eval/loss"]))
    assert params["data.python_version"] == platform.python_version()
    assert int(params["data.corpus_bytes"]) > 0
