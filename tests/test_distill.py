"""On-policy distillation (`extra_algorithms/distill.py`) and the runtime's `teacher` role: the
advantages against a loop, the loss's gradient by hand, its *expected* gradient against the exact
reverse KL's (per token, and per sequence with kl_discount 1) by enumerating every sample, the
runtime's `teacher_logprobs` against a direct forward of the teacher, a tiny student trained by
the generic recipe with --teacher, and the refusals of a missing or mismatched teacher."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_flow.extra_algorithms.distill import DistillConfig, OnPolicyDistillation
from areal_flow.config import PolicyLossConfig
from areal_flow.types import MicroBatch, ModelOutput
from tests.helpers import metrics, run_recipe, run_recipe_cases

# ----------------------------------------------------------------------------------- advantages


@st.composite
def distill_batches(draw):
    """Rows in groups, model tokens with gaps (multi-turn rows), garbage on the pads."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    width = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    rows = len(groups)
    mask = torch.rand(rows, width, generator=gen) < 0.7
    old, teacher = -3 * torch.rand(rows, width, generator=gen), -3 * torch.rand(rows, width, generator=gen)
    old[~mask], teacher[~mask] = float("nan"), float("-inf")  # pads may hold anything
    rewards = torch.randint(0, 3, (rows,), generator=gen).float()
    return groups, mask, old, teacher, rewards


def batch_of(groups, mask, old, teacher, rewards, prox: bool) -> TensorDict:
    rows = len(groups)
    data = {"loss_mask": mask, "teacher_logprobs": teacher, "rewards": rewards,
            "group_ids": torch.tensor(groups)}
    if prox:  # the actor role recomputed π_old; the sampler's logprobs are something else
        data.update(prox_logprobs=old, logprobs=torch.full(mask.shape, 7.0))
    else:
        data["logprobs"] = old
    return TensorDict(data, batch_size=[rows])


def grpo_reference(rewards: list[float], groups: list[int], i: int) -> float:
    members = [r for r, g in zip(rewards, groups) if g == groups[i]]
    if len(members) == 1 or len(set(members)) == 1:
        return 0.0
    return (rewards[i] - sum(members) / len(members)) / (statistics.pstdev(members) + 1e-6)


@settings(max_examples=200, deadline=None)
@given(distill_batches(), st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0.0, 0.7]),
       st.booleans())
def test_advantages_match_a_loop(data, gamma, task_weight, prox):
    groups, mask, old, teacher, rewards = data
    algo = OnPolicyDistillation(DistillConfig(kl_discount=gamma, task_weight=task_weight,
                                              loss=PolicyLossConfig(recompute_proximal=prox)))
    got = algo.advantages(batch_of(groups, mask, old, teacher, rewards, prox))["advantages"]
    for i in range(len(groups)):
        live = [t for t in range(mask.shape[1]) if mask[i, t]]
        k = {t: old[i, t].item() - teacher[i, t].item() for t in live}
        task = task_weight * grpo_reference(rewards.tolist(), groups, i)
        for t in range(mask.shape[1]):
            later = [s for s in live if s >= t]
            want = -sum(gamma ** n * k[s] for n, s in enumerate(later)) + task \
                if mask[i, t] else 0.0
            assert got[i, t].item() == pytest.approx(want, rel=1e-4, abs=1e-4), (i, t)


@settings(max_examples=100, deadline=None)
@given(distill_batches(), st.sampled_from([0.0, 0.5, 1.0]))
def test_a_teacher_equal_to_the_student_gives_no_advantage(data, gamma):
    groups, mask, old, _, rewards = data
    teacher = torch.where(mask, old, float("-inf"))  # the same logprobs on every model token
    algo = OnPolicyDistillation(DistillConfig(kl_discount=gamma))
    out = algo.advantages(batch_of(groups, mask, old, teacher, rewards, prox=True))
    assert bool((out["advantages"] == 0).all())  # exactly: the runtime skips these rows
    assert algo.skips_zero_advantage_rows and algo.roles == ("actor", "teacher")


def test_roles_and_group_size_follow_the_config():
    plain = OnPolicyDistillation(DistillConfig(loss=PolicyLossConfig(recompute_proximal=False)))
    assert plain.roles == ("teacher",) and plain.min_group_size == 1
    assert OnPolicyDistillation(DistillConfig(task_weight=0.5)).min_group_size == 2
    with pytest.raises(ValueError, match="kl_discount"):
        DistillConfig(kl_discount=1.5)


# ----------------------------------------------------------------------------------- loss


def loss_batch(old, teacher, behav, mask, advantages=None, gamma=0.0):
    """One-row-per-sample micro-batch with π_prox = `old` recomputed (the actor role)."""
    rows = old.shape[0]
    batch = TensorDict({"loss_mask": mask, "logprobs": behav, "prox_logprobs": old,
                        "teacher_logprobs": teacher, "rewards": torch.zeros(rows),
                        "group_ids": torch.arange(rows)}, batch_size=[rows])
    return MicroBatch.of(OnPolicyDistillation(DistillConfig(kl_discount=gamma)).advantages(batch))


def test_loss_gradient_by_hand():
    """d loss / d log π_θ = w ρ (log π_old − log π_teacher) per unclipped token, 0 past the clip
    (here a token whose advantage is negative and ρ < 1 − ε), over the token count."""
    mask = torch.tensor([[False, True, True, True], [False, True, False, False]])
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.5, 0.0, 0.0]])
    teacher = torch.tensor([[0.0, -2.0, -1.0, -1.5], [0.0, -0.1, 9.0, 9.0]])
    behav = old + torch.tensor([[0.0, 0.1, -0.2, 0.0], [0.0, 0.3, 0.0, 0.0]])
    mb = loss_batch(old, teacher, behav, mask)
    shift = torch.tensor([[0.0, 0.05, -0.1, -0.5], [0.0, 0.1, 0.0, 0.0]])  # token (0, 3): ρ = e^-0.5
    logp = (old + shift).requires_grad_()
    algo = OnPolicyDistillation(DistillConfig(loss=PolicyLossConfig(importance_weight_cap=None)))
    result = algo.loss(ModelOutput(logprobs=logp), mb)
    result.loss_sum.backward()
    ratio, weight = shift.exp(), (old - behav).exp()
    unclipped = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
    k = (old - teacher) * mask
    torch.testing.assert_close(logp.grad, weight * ratio * k * unclipped)
    assert (result.normalizer, result.unit) == (4.0, "tokens")
    # token (0, 3): A = −k = −1 < 0 and ρ < 1 − ε: clipped, its loss w·0.8·k, no gradient
    want = (weight * ratio * k * unclipped).sum() + weight[0, 3] * 0.8 * k[0, 3]
    assert result.loss_sum.item() == pytest.approx(want.item(), rel=1e-5)
    # the stat: the importance-weighted k1 of π_θ, w ρ (log π_θ − log π_teacher), per token
    kl = (weight * ratio * ((old + shift) - teacher) * mask).sum() / 4
    assert result.stats["distill/reverse_kl"].item() == pytest.approx(kl.item(), rel=1e-5)


def expected_gradient(logits, teacher_logits, gamma: float, *, naive: bool = False):
    """Σ over every sequence y of π(y) · ∇(the loss on y alone), at π_θ = π_old = π_behav, for a
    policy over `len(logits)` positions whose position t's logits depend on y_{t−1}: the
    expectation an on-policy batch estimates, computed exactly. `naive` is the direct loss
    Σ_t (log π_θ(y_t) − log π_teacher(y_t)) on the samples, for comparison."""
    vocab = logits[0].shape[-1]
    total = [torch.zeros_like(x) for x in logits]
    for ys in itertools.product(range(vocab), repeat=len(logits)):
        prev = [0, *ys[:-1]]  # the first position's table has one row
        logp = torch.stack([torch.log_softmax(x[p], -1)[y] for x, p, y in zip(logits, prev, ys)])
        tlogp = torch.stack([torch.log_softmax(x[p], -1)[y]
                             for x, p, y in zip(teacher_logits, prev, ys)])
        prob = logp.sum().exp().detach()
        if naive:
            loss_sum = (logp - tlogp).sum()
        else:
            mask = torch.ones(1, len(ys), dtype=torch.bool)
            mb = loss_batch(logp.detach()[None], tlogp[None], logp.detach()[None], mask,
                            gamma=gamma)
            loss_sum = OnPolicyDistillation(DistillConfig(kl_discount=gamma)).loss(
                ModelOutput(logprobs=logp[None]), mb).loss_sum
        for acc, grad in zip(total, torch.autograd.grad(loss_sum, logits)):
            acc += prob * grad
    return total


def exact_kl(logits, teacher_logits, per_token: bool):
    """The sequence's reverse KL, Σ_t Σ_{y<t} P(y<t) KL(π(·|y<t) ‖ π_teacher(·|y<t)), with the
    prefixes' probabilities P(y<t) held fixed when `per_token` (the gradient then flows only
    through each position's own distribution)."""
    vocab = logits[0].shape[-1]
    kl = 0.0
    for t, (x, tx) in enumerate(zip(logits, teacher_logits)):
        for prefix in itertools.product(range(vocab), repeat=t):
            prev = [0, *prefix]
            prob = torch.ones(())
            for s, y in enumerate(prefix):
                prob = prob * torch.softmax(logits[s][prev[s]], -1)[y]
            ls, lt = torch.log_softmax(x[prev[t]], -1), torch.log_softmax(tx[prev[t]], -1)
            kl = kl + (prob.detach() if per_token else prob) * (ls.exp() * (ls - lt)).sum()
    return kl


@pytest.fixture
def tiny_policy():
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(1, 3, generator=gen).requires_grad_(),
              torch.randn(3, 3, generator=gen).requires_grad_()]
    teacher = [2 * torch.randn(1, 3, generator=gen), 2 * torch.randn(3, 3, generator=gen)]
    return logits, teacher


@pytest.mark.parametrize(("gamma", "per_token"), [(0.0, True), (1.0, False)])
def test_the_expected_gradient_is_the_reverse_kl_gradient(tiny_policy, gamma, per_token):
    """kl_discount 0: the per-token reverse KL's gradient (contexts held fixed); 1: the whole
    sequence's. The direct loss on the same estimate has expected gradient 0 (why the estimate is
    an advantage: docs/algorithms.md)."""
    logits, teacher = tiny_policy
    got = expected_gradient(logits, teacher, gamma)
    want = torch.autograd.grad(exact_kl(logits, teacher, per_token), logits)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    other = torch.autograd.grad(exact_kl(logits, teacher, not per_token), logits)
    assert max((g - o).abs().max().item() for g, o in zip(got, other)) > 1e-2  # they differ
    for g in expected_gradient(logits, teacher, gamma, naive=True):
        torch.testing.assert_close(g, torch.zeros_like(g), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------- runtime


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """Another tiny model of the same tokenizer (another seed)."""
    from areal_flow.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1)


class Recorder:
    """Asks for the teacher and keeps what the runtime wrote into the batch before advantages."""

    roles = ("teacher",)

    def advantages(self, batch):
        self.seen = batch.clone()
        batch["advantages"] = torch.zeros(batch["input_ids"].shape)
        return batch

    def loss(self, out, mb):
        from areal_flow.types import LossOutput

        mask = mb.loss_mask.float()
        return LossOutput(loss_sum=-(out.logprobs * mask).sum(), normalizer=mask.sum(),
                          unit="tokens")


def test_the_runtime_fills_teacher_logprobs_with_the_teachers(world, tiny_model_dir,
                                                               teacher_dir):
    from transformers import AutoModelForCausalLM

    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from tests.dist_train_script import fixed_batch

    config = TrainConfig(max_tokens_per_mb=200)  # several micro-batches
    student = TrainEngine(tiny_model_dir, config)
    teacher = TrainEngine(teacher_dir, config, trainable=False)
    batch = fixed_batch(student.model.config.vocab_size)
    batch["temperature"] = torch.tensor([1.0, 0.5] * 6)  # each row at its own temperature
    with pytest.raises(ValueError, match="teacher"):
        student.train(batch, Recorder())  # no teacher passed: named, before anything runs
    algorithm = Recorder()
    student.train(batch, algorithm, teacher=teacher)
    seen = algorithm.seen  # this rank's rows, in the runtime's order
    mask = seen["loss_mask"]

    direct = AutoModelForCausalLM.from_pretrained(teacher_dir)
    want = torch.zeros(mask.shape)
    with torch.no_grad():
        for i in range(len(mask)):
            n = int(seen["attention_mask"][i].sum())
            ids = seen["input_ids"][i, :n]
            logits = direct(input_ids=ids[None]).logits[0, :-1] / seen["temperature"][i]
            want[i, 1:n] = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
    assert len(mask) == 12 and sorted(seen["temperature"].tolist()) == [0.5] * 6 + [1.0] * 6
    torch.testing.assert_close(seen["teacher_logprobs"][mask], want[mask], atol=1e-5, rtol=1e-5)
    own = student.forward(seen)["logprobs"]  # and it is the teacher's, not the student's
    assert (own[mask] - want[mask]).abs().mean() > 1e-2


# ----------------------------------------------------------------------------------- recipe


def recipe_args(student: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(student), "--dataset", str(data), "--run-dir", str(run_dir),
            "--eval-size", "0", "--rollout.batch-size", "2", "--rollout.group-size", "2",
            "--sampling.max-new-tokens", "16", "--inference.dtype", "float32",
            "--train.dtype", "float32", "--train.optim.lr", "1e-3", *extra]


@pytest.fixture(scope="module")
def peaked_student(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model with its logits scaled 5x (its final norm's weights): far from the nearly
    uniform tiny teacher, ~3 nats of reverse KL, so a few steps show the KL falling."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("peaked_student")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(5.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def test_the_recipe_distills_a_student_towards_the_teacher(peaked_student, teacher_dir,
                                                           gsm8k_file, tmp_path):
    run = tmp_path / "run"
    result = run_recipe("gsm8k_grpo.py", recipe_args(
        peaked_student, gsm8k_file, run, "--algorithm", "distill", "--teacher", str(teacher_dir),
        "--steps", "5"))
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 5 and all(" reverse KL " in line for line in steps), steps
    trained = [m for m in metrics(run) if m["step"] > 0]
    kl = [m["distill/reverse_kl"] for m in trained]
    # seen on seeds 0-2: 3.1-3.4 nats at step 1, then 0.0-0.75 (at most 0.23x the first)
    assert kl[0] > 1.5, kl
    assert all(math.isfinite(x) and x < 0.5 * kl[0] for x in kl[1:]), kl
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["train/skipped_rows"] == 0
               for m in trained), trained
    assert f"teacher: {teacher_dir}" in (run / "config.yaml").read_text()


@pytest.fixture(scope="module")
def other_tokenizer_teacher(tmp_path_factory, teacher_dir) -> Path:
    """The tiny teacher with one token more in its tokenizer (and its embedding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("other_tokenizer")
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    tok.add_tokens(["<|tool|>"])
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


BAD_TEACHER = [
    (["--algorithm", "distill"], "--algorithm distill learns from a teacher model: pass --teacher"),
    (["--algorithm", "distill", "--teacher", "{other}"],
     "its tokenizer is not --model's (430 and 429 tokens"),
    (["--algorithm", "distill", "--teacher", "{tmp}/no-such-teacher"],
     "--teacher {tmp}/no-such-teacher: no model config"),
    (["--teacher", "{teacher}"],  # grpo, the default
     "algorithm grpo has no teacher role, so the teacher would never be used"),
]


@pytest.fixture(scope="module")
def bad_teacher(tiny_model_dir, teacher_dir, other_tokenizer_teacher, gsm8k_file,
                tmp_path_factory):
    """Each command line of BAD_TEACHER run by the recipe, all in one process: its extra
    arguments -> (its run folder, exit code, what it printed), with `fill` applied."""
    tmp = tmp_path_factory.mktemp("bad_teacher")
    fill = {"{tmp}": str(tmp), "{other}": str(other_tokenizer_teacher),
            "{teacher}": str(teacher_dir)}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    cases = {json.dumps([filled(a) for a in extra]): recipe_args(
        tiny_model_dir, gsm8k_file, tmp / f"run{i}", "--steps", "1", *map(filled, extra))
        for i, (extra, _) in enumerate(BAD_TEACHER)}
    results = run_recipe_cases(cases, tmp)

    def outcome(extra: list[str]) -> tuple[Path, int, str]:
        case = json.dumps([filled(a) for a in extra])
        return (Path(cases[case][cases[case].index("--run-dir") + 1]), *results[case])

    return outcome, filled


@pytest.mark.faults
@pytest.mark.parametrize(("extra", "message"), BAD_TEACHER)
def test_a_missing_or_mismatched_teacher_is_refused_before_any_weights_load(
        bad_teacher, extra, message):
    outcome, filled = bad_teacher
    run_dir, code, output = outcome(extra)
    assert code != 0
    assert filled(message) in output, output[-2000:]
    assert "Loading weights" not in output  # transformers' progress line when a model loads
    # no config.yaml, metrics.jsonl, ... (run.lock, the live run's lock, stays: see run_lock.py)
    assert not [p for p in run_dir.glob("*.*") if p.name != "run.lock"]
