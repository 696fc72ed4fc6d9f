"""DPO: the loss and its gradient against a plain-torch reference and closed forms, pairs kept on
one rank and mini-batch (and a step that splits them across micro-batches equal to one that does
not), and recipes/dpo.py on the tiny model: the held-out margin rises, it resumes exactly, and a
dataset without the pair's fields is refused by name."""

from __future__ import annotations

import json
import math
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_flow import algorithms
from areal_flow.extra_algorithms.dpo import DPO, DPOConfig
from areal_flow.data import offline
from areal_flow.extra_algorithms.preference import (PreferencePair, collate_pairs, gsm8k_format_pairs,
                                        pair_from_row)
from areal_flow.runtime.microbatch import groups_to_ranks, micro_batches, minibatch_of_rows
from areal_flow.types import MicroBatch, ModelOutput
from tests.helpers import ROOT, metrics, run_recipe

CONFIGS = [DPOConfig(), DPOConfig(beta=0.5, label_smoothing=0.2), DPOConfig(loss_type="ipo"),
           DPOConfig(beta=1.0, loss_type="ipo")]


# ---------------------------------------------------------------------------- the loss


def reference_loss(logp, ref, mask, pairs, config):
    """Mean over pairs of the per-pair loss, from per-sequence sums over the masked tokens only
    (indexing, so whatever the pads hold never enters)."""
    def seq(x, row):
        return sum((x[row, t] for t in range(x.shape[1]) if mask[row, t]), x[row, 0] * 0.0)

    losses = []
    for w, l in pairs:
        d = (seq(logp, w) - seq(ref, w)) - (seq(logp, l) - seq(ref, l))
        if config.loss_type == "ipo":
            losses.append((d - 1 / (2 * config.beta)) ** 2)
        else:
            z = config.beta * d
            eps = config.label_smoothing
            losses.append(-(1 - eps) * torch.nn.functional.logsigmoid(z)
                          - eps * torch.nn.functional.logsigmoid(-z))
    return torch.stack(losses).mean()


def make_batch(pairs, logp, ref, mask, order):
    """Rows in `order`; pads of the model's, the reference's and the pre-update log-probs
    hold ±inf / NaN / huge values."""
    rows = len(order)
    group = torch.empty(rows, dtype=torch.long)
    chosen = torch.zeros(rows, dtype=torch.bool)
    for g, (w, l) in enumerate(pairs):
        group[w], group[l], chosen[w] = g, g, True
    junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30])[
        torch.arange(mask.numel()).reshape(mask.shape) % 4]
    batch = TensorDict({
        "loss_mask": mask, "group_ids": group, "chosen": chosen,
        "ref_logprobs": torch.where(mask, ref, junk),
        "prox_logprobs": torch.where(mask, logp, junk.flip(0)),
    }, batch_size=[rows])
    return batch[torch.tensor(order)]


def dpo_on(batch, logp, mask, order, config, parts):
    """Σ loss_sum / Σ normalizer and its gradient w.r.t. the model's log-probs (pads NaN) of
    the rows in `order`, over micro-batches `parts` (lists of positions in `batch`)."""
    batch = DPO(config).advantages(batch.clone())
    model = torch.where(mask, logp, torch.tensor(math.nan))[torch.tensor(order)]
    model.requires_grad_()
    total, norm = 0.0, 0.0
    for part in parts:
        index = torch.tensor(part, dtype=torch.long)
        out = DPO(config).loss(ModelOutput(logprobs=model[index]),
                                  MicroBatch.of(batch[index]))
        assert out.unit == "sequences"
        total, norm = total + out.loss_sum, norm + out.normalizer
    (total / norm).backward()
    return (total / norm).detach(), model.grad


def check_against_reference(pairs, logp, mask, ref, config, order, parts):
    expected_logp = logp.clone().requires_grad_()
    expected = reference_loss(expected_logp, ref, mask, pairs, config)
    expected.backward()
    loss, grad = dpo_on(make_batch(pairs, logp, ref, mask, order), logp, mask, order, config,
                        parts)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_logp.grad[torch.tensor(order)], rtol=1e-5,
                               atol=1e-6)
    return loss, grad


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from(CONFIGS),
       st.integers(0, 2**31), st.data())
def test_loss_and_gradient_match_a_reference_however_rows_are_ordered_and_split(
        n, width, config, seed, data):
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * n
    mask = torch.rand(rows, width, generator=gen) < 0.7
    logp = -3 * torch.rand(rows, width, generator=gen)
    ref = -3 * torch.rand(rows, width, generator=gen)
    order = data.draw(st.permutations(range(rows)))
    pairs = [(2 * g, 2 * g + 1) for g in range(n)]
    # micro-batches: any partition of the batch's positions (a pair may be split)
    labels = data.draw(st.lists(st.integers(0, 2), min_size=rows, max_size=rows))
    parts = [[i for i in range(rows) if labels[i] == k] for k in range(3)]
    check_against_reference(pairs, logp, mask, ref, config, order, [p for p in parts if p])


@pytest.mark.parametrize("config", CONFIGS, ids=["sigmoid", "smoothed", "ipo", "ipo-beta1"])
@pytest.mark.parametrize("split", [False, True])
def test_loss_and_gradient_on_fixed_pairs(config, split):
    mask = torch.tensor([[False, True, True, False], [False, True, True, True],
                         [False, False, True, False], [False, True, True, False]])
    logp = torch.tensor([[0.0, -1.0, -0.5, 0.0], [0.0, -2.0, -0.3, -0.2],
                         [0.0, 0.0, -1.2, 0.0], [0.0, -0.4, -0.9, 0.0]])
    ref = torch.tensor([[0.0, -1.2, -0.7, 0.0], [0.0, -1.5, -0.3, -0.1],
                        [0.0, 0.0, -0.2, 0.0], [0.0, -0.6, -0.8, 0.0]])
    parts = [[0, 2], [1, 3]] if split else [[0, 1, 2, 3]]
    loss, grad = check_against_reference([(0, 1), (3, 2)], logp, mask, ref, config,
                                         [0, 1, 2, 3], parts)
    # and against the closed form: h = Σ (log π − log π_ref) over the mask is 0.4, −0.6 (pair 1)
    # and −1.0, 0.1 (rows 2 and 3: pair 2, chosen second), so d = 1.0 and 1.1
    d = torch.tensor([1.0, 1.1], dtype=torch.float64)
    b, eps = config.beta, config.label_smoothing
    if config.loss_type == "ipo":
        losses, slopes = (d - 1 / (2 * b)) ** 2, 2 * (d - 1 / (2 * b))
    else:
        sig = torch.sigmoid(b * d)
        losses = -(1 - eps) * torch.log(sig) - eps * torch.log(1 - sig)
        slopes = -b * (1 - eps) * (1 - sig) + b * eps * sig  # dL/dd
    assert loss.item() == pytest.approx(losses.mean().item(), rel=1e-5)
    sign = torch.tensor([1.0, -1.0, -1.0, 1.0])[:, None]
    slope_of_row = torch.tensor([slopes[0], slopes[0], slopes[1], slopes[1]])[:, None]
    want = (sign * slope_of_row / 2 * mask).float()  # mean over 2 pairs
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)


def test_metrics_are_the_batch_rewards_before_the_update():
    mask = torch.ones(4, 2, dtype=torch.bool)
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-2.0, -1.0], [-1.0, -1.0]])
    ref = torch.full((4, 2), -1.0)
    batch = DPO(DPOConfig(beta=0.5)).advantages(make_batch([(0, 1), (2, 3)], logp, ref, mask,
                                                           [0, 1, 2, 3]))
    out = DPO(DPOConfig(beta=0.5)).loss(ModelOutput(logprobs=logp),
                                             MicroBatch.of(batch[torch.tensor([2])]))
    # β·h: chosen 0 and 0.5·(−1) = −0.5, rejected 0 and 0: margins 0 and −0.5, none > 0
    assert {k: float(v) for k, v in out.stats.items()} == {
        "rewards/chosen": -0.25, "rewards/rejected": 0.0, "rewards/margin": -0.25,
        "rewards/accuracy": 0.0}


def test_bad_groups_and_options_are_refused():
    mask = torch.ones(3, 2, dtype=torch.bool)
    batch = TensorDict({"loss_mask": mask, "group_ids": torch.tensor([0, 0, 0]),
                        "chosen": torch.tensor([True, False, False]),
                        "ref_logprobs": torch.zeros(3, 2), "prox_logprobs": torch.zeros(3, 2)},
                       batch_size=[3])
    with pytest.raises(ValueError, match="group 0 has 3 row"):
        DPO().advantages(batch)
    batch["group_ids"], batch["chosen"] = torch.tensor([0, 0, 1]), torch.tensor([1, 1, 0]) > 0
    with pytest.raises(ValueError, match="one chosen and one rejected"):
        DPO().advantages(batch)
    with pytest.raises(ValueError, match="preference pairs.*no 'chosen' key"):
        DPO().advantages(batch.exclude("chosen"))
    with pytest.raises(ValueError, match="sigmoid loss only"):
        DPOConfig(loss_type="ipo", label_smoothing=0.1)


def test_dpo_is_registered_and_announced():
    spec = algorithms.spec("dpo")
    assert (spec.cls, spec.config) == (DPO, DPOConfig)
    assert DPO().roles == ("actor", "ref")
    announced = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    value = announced["areal_flow.algorithms"]["dpo"]
    assert EntryPoint("dpo", value, "areal_flow.algorithms").load() is DPO


# ---------------------------------------------------------------------------- pairs in batches


PAIRS = [PreferencePair(f"What is {a} plus {b}?", f"{a} + {b} = {a + b}\n#### {a + b}",
                        f"{a} + {b} = {a + b}\nThe answer is {a + b}.")
         for a, b in [(1, 2), (10, 20), (3, 40), (7, 7), (123, 456), (0, 5)]]


def test_pairs_are_adjacent_rows_of_one_group_on_one_rank_and_mini_batch(tokenizer):
    batch = collate_pairs(tokenizer, PAIRS)
    assert batch["group_ids"].tolist() == [g for g in range(len(PAIRS)) for _ in range(2)]
    assert batch["chosen"].tolist() == [True, False] * len(PAIRS)
    assert batch["rewards"].tolist() == [1.0, 0.0] * len(PAIRS)
    for g, pair in enumerate(PAIRS):
        for row, response in ((2 * g, pair.chosen), (2 * g + 1, pair.rejected)):
            ids, loss = batch["input_ids"][row], batch["loss_mask"][row]
            assert tokenizer.decode(ids[loss]) == response + tokenizer.eos_token
            first = int(loss.nonzero()[0])  # the context: the same rendered prompt
            assert tokenizer.decode(ids[:first]) == tokenizer.apply_chat_template(
                [{"role": "user", "content": pair.prompt}], tokenize=False,
                add_generation_prompt=True)
    lengths = batch["attention_mask"].sum(-1).tolist()
    groups = batch["group_ids"].tolist()
    for world in (1, 2, 3, 4):
        for rank_rows in groups_to_ranks(groups, lengths, world):
            assert all(r ^ 1 in rank_rows for r in rank_rows), (world, rank_rows)
    for parts in (1, 2, 3, 4):
        mini = minibatch_of_rows(batch["group_ids"], parts)
        assert torch.equal(mini[0::2], mini[1::2]), parts
    # micro-batches are cut by length alone: a small budget splits pairs (what the DPO loss is
    # written for, tested above and in the next test)
    bins = micro_batches(lengths, max(lengths) + 2)
    assert any(r ^ 1 not in b for b in bins for r in b), bins


def test_batch_of_pairs_from_rows_and_from_gsm8k(tmp_path):
    assert pair_from_row({"q": "x", "good": "a", "bad": "b"}, "q", "good", "bad") == \
        PreferencePair("x", "a", "b")
    with pytest.raises(KeyError, match=r"no \['chosen', 'rejected'\]"):
        pair_from_row({"prompt": "x", "answer": "a"})
    with pytest.raises(TypeError, match="'chosen'.*must be a string"):
        pair_from_row({"prompt": "x", "chosen": [{"role": "assistant"}], "rejected": "b"})
    pairs = gsm8k_format_pairs([{"question": "q", "answer": "2 + 2 = 4\n#### 4"},
                                {"question": "r", "answer": "no final line"}])
    assert pairs == [PreferencePair("q", "2 + 2 = 4\n#### 4", "2 + 2 = 4\nThe answer is 4.")]


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_step_that_splits_pairs_across_micro_batches_equals_one_that_does_not(
        world, tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from areal_flow.runtime.engine import TrainConfig, TrainEngine

    # a policy away from the reference, so that the pairs' losses differ
    moved = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    moved.save_pretrained(tmp_path / "moved")
    batch = collate_pairs(tokenizer, PAIRS)
    lengths = batch["attention_mask"].sum(-1).tolist()
    ref = TrainEngine(tiny_model_dir, TrainConfig(), trainable=False)
    results = []
    for budget in (10**6, max(lengths) + 2):
        trainer = TrainEngine(tmp_path / "moved", TrainConfig(max_tokens_per_mb=budget))
        split = sum(any(r ^ 1 not in b for r in b) for b in trainer._plan(batch))
        stats = trainer.train(batch, DPO(DPOConfig(beta=0.5)), ref=ref)
        results.append((split, stats, trainer.full_grads()))
    (whole, one, grads), (split, many, split_grads) = results
    assert whole == 0 and split > 0, (whole, split)
    assert one["train/micro_batches"] == 1 and many["train/micro_batches"] > 2
    assert abs(one["rewards/margin"]) > 1e-2, one  # the pairs are not at the reference
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- the recipe


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory, gsm8k_file):
    """The conftest GSM8K rows as answer-format pairs, as a jsonl of prompt/chosen/rejected."""
    rows = [json.loads(line) for line in gsm8k_file.read_text().splitlines()]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": p.prompt, "chosen": p.chosen,
                                        "rejected": p.rejected}) + "\n"
                            for p in gsm8k_format_pairs(rows)))
    return path


def dpo_args(model: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    # a micro-batch budget of about two rows: most pairs are split between micro-batches
    return ["--model", str(model), "--dataset", str(data), "--run-dir", str(run_dir),
            "--steps", "6", "--eval-size", "4", "--eval-every", "3", "--save-every", "3",
            "--batch-size", "4", "--train.dtype", "float32", "--train.optim.lr", "1e-2",
            "--train.max-tokens-per-mb", "90", *extra]


def logprob(model_dir: Path, prompt: str, response: str) -> float:
    """log π(response + end of turn | the chat's prompt), summed over the response's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    context = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)
    target = tokenizer.encode(response + tokenizer.eos_token, add_special_tokens=False)
    ids = torch.tensor([context + target])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1:-1].float()
    return float(logits.log_softmax(-1).gather(-1, ids[0, len(context):, None]).sum())


def test_the_recipe_raises_the_heldout_margin_and_resumes_exactly(tiny_model_dir, pairs_file,
                                                                  tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    result = run_recipe("dpo.py", dpo_args(tiny_model_dir, pairs_file, straight))
    assert "done:" in result.stdout
    logged = metrics(straight)
    evals = {m["step"]: m for m in logged if "eval/margin" in m}
    assert sorted(evals) == [0, 3, 6]
    assert evals[0]["eval/margin"] == pytest.approx(0.0, abs=1e-4)  # the policy is the reference
    assert evals[6]["eval/margin"] > evals[3]["eval/margin"] > 0.3, evals
    assert evals[6]["eval/accuracy"] == 1.0 and evals[6]["eval/loss"] < 0.5, evals[6]
    # measured again without the recipe's code: β·[(log π − log π_ref)(chosen) − (same)(rejected)]
    # of the held-out pairs, with the trained model's full-vocabulary softmax
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    held = offline.split_rows(rows, 4)[1]
    trained_model = straight / "checkpoints" / "step-000006" / "hf"
    margins = [0.1 * ((logprob(trained_model, r["prompt"], r["chosen"])
                       - logprob(tiny_model_dir, r["prompt"], r["chosen"]))
                      - (logprob(trained_model, r["prompt"], r["rejected"])
                         - logprob(tiny_model_dir, r["prompt"], r["rejected"]))) for r in held]
    assert min(margins) > 0.3, margins
    assert sum(margins) / len(margins) == pytest.approx(evals[6]["eval/margin"], rel=1e-3)
    trained = [m for m in logged if m["step"] > 0]
    assert [m["step"] for m in trained] == list(range(1, 7))
    assert trained[-1]["rewards/margin"] > trained[0]["rewards/margin"] + 0.3, trained
    assert all(math.isfinite(m["loss"]) and m["train/micro_batches"] > 2 for m in trained)

    run_recipe("dpo.py", dpo_args(tiny_model_dir, pairs_file, stopped, "--steps", "3"))
    run_recipe("dpo.py", dpo_args(tiny_model_dir, pairs_file, stopped, "--resume"))
    resumed = metrics(stopped)
    assert [m["step"] for m in resumed] == [m["step"] for m in logged]
    for a, b in zip(resumed, logged):
        for key in ("loss", "rewards/margin", "eval/margin"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_the_recipe_names_the_missing_pair_fields(tiny_model_dir, gsm8k_file, tmp_path):
    result = run_recipe("dpo.py", dpo_args(tiny_model_dir, gsm8k_file, tmp_path / "run"),
                        check=False)
    assert result.returncode != 0
    assert "no ['prompt', 'chosen', 'rejected']" in result.stderr, result.stderr[-2000:]
    assert "--chosen-field" in result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
