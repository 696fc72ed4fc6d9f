"""examples/plugins/countdown, installed for real with pip: its reward against an independent
evaluator and the reward contract, its data, its leave-one-out algorithm against a loop and a
hand-derived gradient, its two-turn workflow on scripted replies, and the whole plugin trained
by the generic recipe with `--algorithm countdown.loo`, no recipe copied."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_flow.testing.contract import check_reward
from areal_flow.testing.strategies import answered, completion_text
from areal_flow.types import MicroBatch, ModelOutput, RewardSpec, SamplingParams
from areal_flow.workflow.context import RolloutContext
from tests.helpers import ScriptedPool, install_plugin, metrics, plugin_rows, run_cli, run_python, run_recipe

PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "plugins" / "countdown"


@pytest.fixture(scope="session")
def countdown_site(tmp_path_factory) -> Path:
    """examples/plugins/countdown installed with pip into a folder of its own."""
    return install_plugin("countdown", tmp_path_factory.mktemp("countdown_site"))


@pytest.fixture(scope="module")
def ct(countdown_site):
    """The installed `countdown_task` module, imported in this process (and importable by the
    reward workers, which take this process's sys.path)."""
    sys.path.insert(0, str(countdown_site))
    try:
        yield importlib.import_module("countdown_task")
    finally:
        sys.path.remove(str(countdown_site))


# ----------------------------------------------------------------------------------- packaging


def test_the_installed_plugin_is_listed_and_resolved_without_torch(countdown_site):
    cells = plugin_rows(countdown_site, "countdown")
    dist = "areal-flow-countdown 0.1.0"
    assert sorted(cells) == sorted([
        ["workflow", "countdown.single_turn", dist, "countdown_task:single_turn"],
        ["workflow", "countdown.two_turn", dist, "countdown_task:two_turn"],
        ["reward", "countdown", dist, "countdown_task:countdown"],
        ["algorithm", "countdown.loo", dist, "countdown_task:LOO"],
    ])
    out = run_python(
        """
        import sys
        from areal_flow import algorithms, rewards, workflows
        spec = rewards.spec("countdown")
        print(spec.fn("so <answer>(50 - 25) * 3</answer>", numbers=[3, 7, 25, 50], target=75),
              spec.timeout, spec.range, spec.metrics.__name__)
        print(workflows.spec("countdown.two_turn").config.__name__)
        loo = algorithms.spec("countdown.loo")
        built = loo.cls(loo.config(clip_eps=0.3))
        print(type(built).__name__, built.config.clip_eps, built.roles, "torch" in sys.modules)
        """,
        countdown_site,
    )
    assert out.stdout.splitlines() == ["1.0 2.0 (0.0, 1.0) countdown_metrics",
                                       "CountdownConfig", "LOO 0.3 () False"]


def test_the_dataset_one_liner_works_from_a_fresh_clone(ct, tmp_path):
    # the README's command, with the plugin's folder on PYTHONPATH instead of installed
    path = tmp_path / "countdown.jsonl"
    subprocess.run([sys.executable, "-m", "countdown_task", str(path), "--rows", "64"],
                   check=True, env={**os.environ, "PYTHONPATH": str(PLUGIN)}, capture_output=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == ct.make_rows(64, seed=0) and len(rows) == 64
    assert len({json.dumps(r) for r in rows}) > 60  # not one problem repeated


# ----------------------------------------------------------------------------------- reward

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
       "/": lambda a, b: a / b if b else None}


@st.composite
def expressions(draw, depth: int = 3) -> tuple[str, Fraction | None, list[int]]:
    """(text, exact value or None when it divides by zero, numbers it uses), the value and the
    numbers computed on the tree drawn, never by parsing the text."""
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        n = draw(st.integers(0, 60))
        return str(n), Fraction(n), [n]
    if draw(st.integers(0, 5)) == 0:  # unary minus
        text, value, used = draw(expressions(depth - 1))
        return f"-{text}", None if value is None else -value, used
    (a, x, u), (b, y, w) = draw(expressions(depth - 1)), draw(expressions(depth - 1))
    if draw(st.integers(0, 4)) == 0:  # divided by a zero: a / (b - b)
        return f"({a} / ({b} - {b}))", None, u + w + w
    op, space = draw(st.sampled_from("+-*/")), draw(st.sampled_from(["", " "]))
    value = None if x is None or y is None else OPS[op](x, y)
    return f"({a}{space}{op}{space}{b})", value, u + w


@st.composite
def problems(draw) -> tuple[str, Fraction | None, list[int], list[int], int]:
    """An expression, a pool of numbers (all it uses plus extras, or missing one use of a
    number it uses) and a target (its value when that is whole, or any number)."""
    text, value, used = draw(expressions())
    pool = used + draw(st.lists(st.integers(0, 60), max_size=3))
    if draw(st.booleans()):
        pool.remove(draw(st.sampled_from(used)))  # one use too many, unless an extra is that number
    pool = draw(st.permutations(pool))
    whole = value is not None and value.denominator == 1
    target = int(value) if whole and draw(st.booleans()) else draw(st.integers(-50, 300))
    return text, value, used, list(pool), target


def reference(value: Fraction | None, used: list[int], numbers: list[int], target: int) -> float:
    if Counter(used) - Counter(numbers):  # a number not given, or used more often than given
        return 0.0
    if value is None:  # a division by zero
        return 0.0
    return 1.0 if value == target else 0.1


def matches_reference(reward_fn):
    """A hypothesis test: `reward_fn` scores every drawn expression as `reference` does."""
    @settings(max_examples=300, deadline=None, database=None, report_multiple_bugs=False)
    @given(problems(), st.sampled_from(["", "Let me think. ", "<answer>7</answer> no: "]))
    def check(problem, before):
        text, value, used, numbers, target = problem
        completion = f"{before}<answer>{text}</answer>"
        assert reward_fn(completion, numbers=numbers, target=target) == \
            reference(value, used, numbers, target), (completion, numbers, target)

    return check


def test_the_reward_matches_an_independent_evaluator(ct):
    matches_reference(ct.countdown)()


def test_the_reference_catches_a_reward_that_ignores_the_number_constraint(ct):
    def ignores_numbers(completion, *, numbers, target):  # the bug: never checks `numbers`
        verdict = ct.judge(completion, numbers, target)
        return 0.0 if verdict.value is None else 1.0 if verdict.value == target else 0.1

    with pytest.raises(AssertionError):
        matches_reference(ignores_numbers)()


def test_generated_rows_are_solved_by_their_solution_and_only_by_right_answers(ct):
    def value_of(solution):  # an independent evaluator, for the generator's own strings
        return eval(re.sub(r"\d+", r"Fraction(\g<0>)", solution), {"Fraction": Fraction})

    for row in ct.make_rows(200, seed=3):
        numbers, target, solution = row["numbers"], row["target"], row["solution"]
        assert len(numbers) == 4 and all(1 <= n <= 99 for n in numbers)
        assert isinstance(target, int) and 1 <= target <= 100 and value_of(solution) == target
        assert not Counter(map(int, re.findall(r"\d+", solution))) - Counter(numbers)
        assert f"{numbers}" in row["question"] and f"equals {target}." in row["question"]
        assert ct.countdown(f"<answer>{solution}</answer>", numbers=numbers, target=target) == 1.0
        assert ct.countdown(f"<answer>{solution}</answer>", numbers=numbers,
                            target=target + 1) == 0.1  # well formed, wrong value
        twice = f"({solution}) * ({solution}) / ({solution})"  # the right value, numbers twice
        assert ct.countdown(f"<answer>{twice}</answer>", numbers=numbers, target=target) == 0.0


def test_the_last_answer_counts_and_the_metrics_say_why(ct):
    numbers, target = [3, 7, 25, 50], 75
    score = lambda text: ct.countdown(text, numbers=numbers, target=target)  # noqa: E731
    metrics = lambda text: ct.countdown_metrics(text, numbers=numbers, target=target)  # noqa: E731
    assert score("<answer>50 + 3</answer> no, <answer>50 + 25</answer>") == 1.0
    assert score("<answer>50 + 25</answer> no, <answer>50 + 3</answer>") == 0.1
    assert metrics("<answer>(50 - 25) * 3</answer>") == \
        {"solved": 1.0, "format": 1.0, "numbers_valid": 1.0}
    assert metrics("<answer>25 * 3 + 0</answer>") == \
        {"solved": 0.0, "format": 1.0, "numbers_valid": 0.0}  # 0 was not given
    assert metrics("<answer>50 / (7 - 7)</answer>") == \
        {"solved": 0.0, "format": 1.0, "numbers_valid": 0.0}  # 7 given once
    assert score("<answer>50 / (3 - 3)</answer>") == 0.0
    for junk in ["75", "<answer>75.0</answer>", "<answer>__import__('os')</answer>",
                 "<answer>5 ** 2 * 3</answer>", "<answer>50 // 2</answer>", "<answer></answer>",
                 "<answer>" + "(" * 150 + "3" + ")" * 150 + "</answer>"]:
        assert score(junk) == 0.0 and metrics(junk)["format"] == 0.0, junk


JUNK = st.lists(st.one_of(completion_text(), st.sampled_from(
    ["<answer>", "</answer>", "(", ")", "/0", "/", "-", "*", "**", "+", "3", "٣", "1e9", "0x1f",
     "1_0", "9" * 400, "(" * 300, " "])), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(JUNK, st.lists(st.integers()), st.integers())
def test_junk_never_raises(ct, completion, numbers, target):
    score = ct.countdown(completion, numbers=numbers, target=target)
    metrics = ct.countdown_metrics(completion, numbers=numbers, target=target)
    assert score in (0.0, 0.1, 1.0) and set(metrics.values()) <= {0.0, 1.0}
    assert (score == 1.0) == (metrics["solved"] == 1.0)


def answered_with_numbers():
    """`strategies.answered` in the <answer> syntax, its reference as the target and the
    completion's number among the numbers: about half the completions are right."""
    def numbers_for(pair):
        completion, kwargs = pair
        return completion, {"numbers": [abs(int(Decimal(kwargs["target"])))], **kwargs}

    return answered(("answer_tag",), answer_field="target").map(numbers_for)


def countdown_examples():
    """Hostile text, then an <answer> with an arithmetic expression (divisions by zero too)."""
    return st.tuples(completion_text(), problems()).map(
        lambda t: (f"{t[0]} <answer>{t[1][0]}</answer>", {"numbers": t[1][3], "target": t[1][4]}))


def test_the_reward_passes_the_contract(ct):
    assert ct.countdown("x <answer>-1234</answer>", numbers=[1234], target="-1234") == 1.0
    for examples in (None, answered_with_numbers(), countdown_examples()):
        report = check_reward("countdown", examples=examples)
        assert report.ok, report.summary()


def test_the_contract_catches_a_reward_that_crashes_on_a_division_by_zero(ct):
    def divides(completion: str, *, numbers: list[int], target: int) -> float:
        found = ct.ANSWER.findall(completion)
        try:  # the bug: catches what `evaluate` raises for a bad expression, not ZeroDivisionError
            return float(bool(found) and ct.evaluate(found[-1].strip()) == target)
        except ValueError:
            return 0.0

    report = check_reward(RewardSpec(name="divides", fn=divides, timeout=2.0),
                          examples=countdown_examples())
    assert not report.ok and "'never raises'" in report.failure, report.summary()
    assert "ZeroDivisionError" in report.failure


# ----------------------------------------------------------------------------------- algorithm

REWARDS = st.integers(0, 10).map(lambda k: k / 10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(REWARDS, min_size=1, max_size=5), min_size=1, max_size=5),
       st.booleans(), st.randoms(use_true_random=False))
def test_loo_advantages_match_a_loop(ct, groups, std_normalize, rng):
    rows = [(g, r) for g, group in enumerate(groups) for r in group]
    rng.shuffle(rows)  # groups need not be adjacent
    mask = torch.tensor([[rng.random() < 0.7 for _ in range(6)] for _ in rows])
    batch = TensorDict({"rewards": torch.tensor([r for _, r in rows]),
                        "group_ids": torch.tensor([g for g, _ in rows]),
                        "loss_mask": mask}, batch_size=[len(rows)])
    got = ct.LOO(ct.LOOConfig(std_normalize=std_normalize)).advantages(batch)["advantages"]
    for i, (g, r) in enumerate(rows):
        group = [s for h, s in rows if h == g]
        others = list(group)
        others.remove(r)
        advantage = r - sum(others) / len(others) if others else 0.0
        if std_normalize and advantage:
            mean = sum(group) / len(group)
            std = (sum((s - mean) ** 2 for s in group) / len(group)) ** 0.5
            advantage /= std + 1e-6
        for t in range(6):
            assert got[i, t].item() == pytest.approx(advantage if mask[i, t] else 0.0,
                                                     rel=1e-4, abs=1e-5)


def test_loo_loss_gradient_matches_the_hand_derived_one(ct):
    """d loss / d log pi_theta = -w rho A / N on every model token the clip leaves alone, 0 on
    clipped ones (rho = pi_theta / pi_prox, w = min(pi_prox / pi_behav, cap), N model tokens)."""
    eps, cap = 0.2, 2.0
    mask = torch.tensor([[False, True, True, True, True], [False, True, True, True, False]])
    behav = torch.tensor([[0.0, -1.0, -2.0, -1.5, -0.5], [0.0, -0.7, -1.2, -2.0, 0.0]])
    prox = behav + torch.tensor([[0.0, 0.0, 0.3, 1.0, -0.2], [0.0, 0.1, 0.0, -0.4, 0.0]])
    shift = torch.tensor([[0.0, 0.05, 0.5, -0.1, 0.1], [0.0, -0.5, 0.1, 0.05, 0.0]])
    logp = (prox + shift).requires_grad_()
    loo = ct.LOO(ct.LOOConfig(clip_eps=eps, weight_cap=cap, recompute_proximal=True))
    assert loo.roles == ("actor",)
    batch = loo.advantages(TensorDict({
        "rewards": torch.tensor([1.0, 0.1]), "group_ids": torch.tensor([0, 0]),
        "loss_mask": mask}, batch_size=[2]))
    assert batch["advantages"][:, 1].tolist() == pytest.approx([0.9, -0.9])
    mb = MicroBatch(loss_mask=mask, advantages=batch["advantages"], logprobs=behav,
                    prox_logprobs=prox)
    result = loo.loss(ModelOutput(logprobs=logp), mb)
    assert (result.normalizer, result.unit) == (7.0, "tokens")
    (result.loss_sum / result.normalizer).backward()

    with torch.no_grad():
        adv, rho = batch["advantages"], (logp - prox).exp()
        w = (prox - behav).exp().clamp(max=cap)
        clipped = ((adv > 0) & (rho > 1 + eps)) | ((adv < 0) & (rho < 1 - eps))
        want = torch.where(mask & ~clipped, -w * rho * adv / 7, 0.0)
        value = torch.where(mask, w * torch.maximum(-rho * adv, -rho.clamp(1 - eps, 1 + eps) * adv),
                            0.0).sum() / 7
    assert clipped[mask].sum() == 2  # tokens (0, 2) and (1, 1); (0, 3) has w capped
    torch.testing.assert_close(logp.grad, want)
    assert (result.loss_sum / result.normalizer).item() == pytest.approx(value.item())


def test_loo_on_policy_gradient_is_reinforce_with_the_leave_one_out_baseline(ct):
    """As the runtime calls it (roles=(): no prox_logprobs), on tokens of the current version:
    d loss / d log pi = -A / N, the RLOO policy gradient."""
    mask = torch.tensor([[False, True, True], [False, True, False], [False, True, True]])
    behav = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.3, 0.0], [0.0, -0.8, -0.1]])
    logp = behav.clone().requires_grad_()
    loo = ct.LOO()
    assert loo.roles == ()
    batch = loo.advantages(TensorDict({
        "rewards": torch.tensor([1.0, 0.0, 0.1]), "group_ids": torch.tensor([4, 4, 4]),
        "loss_mask": mask, "logprobs": behav, "versions": torch.where(mask, 3, -1),
        "policy_version": torch.tensor([3, 3, 3]), "minibatch_progress": torch.zeros(3)},
        batch_size=[3]))
    result = loo.loss(ModelOutput(logprobs=logp), MicroBatch.of(batch))
    (result.loss_sum / result.normalizer).backward()
    advantages = torch.tensor([1.0 - 0.05, 0.0 - 0.55, 0.1 - 0.5])  # r_i - mean of the others
    torch.testing.assert_close(logp.grad, torch.where(mask, -advantages[:, None] / 5, 0.0))


# ----------------------------------------------------------------------------------- workflows


@pytest.fixture(scope="module")
def runner(ct):
    from areal_flow.reward.runner import RewardRunner

    with RewardRunner(max_workers=1) as r:  # its workers import countdown_task via sys.path
        yield r


SAMPLE = {"numbers": [3, 3, 25, 50], "target": 75, "question": "Make 75 from [3, 3, 25, 50]."}


def play(ct, tokenizer, runner, name, replies, config=None):
    from areal_flow import workflows

    pool = ScriptedPool(tokenizer, [r if isinstance(r, tuple) else (r, "stop") for r in replies])
    ctx = RolloutContext(pool=pool, tokenizer=tokenizer, score=runner.score,
                         sampling=SamplingParams(max_new_tokens=32), episode_id="0/0/0",
                         config=config)
    episode = asyncio.run(workflows.get(name)(ctx, SAMPLE))
    segments = [(s.trainable, tokenizer.decode(s.token_ids)) for s in episode.segments]
    return episode, segments, pool, ctx.metrics


def test_two_turn_feeds_back_the_value_and_trains_on_both_answers_only(ct, tokenizer, runner):
    episode, segments, pool, metrics = play(
        ct, tokenizer, runner, "countdown.two_turn",
        ["<answer>50 + 25 - 3</answer>", "<answer>50 + 25</answer>"])
    feedback = "Your expression evaluates to 72, not 75. Try again."
    assert segments == [
        (False, f"<|im_start|>user\n{SAMPLE['question']}<|im_end|>\n<|im_start|>assistant\n"),
        (True, "<answer>50 + 25 - 3</answer><|im_end|>"),
        (False, f"\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"),
        (True, "<answer>50 + 25</answer><|im_end|>"),
    ]
    assert episode.reward == pytest.approx(0.9) and episode.info["turns"] == 2
    assert metrics == {"solved": 1.0, "format": 1.0, "numbers_valid": 1.0}  # the last attempt's
    assert episode.metrics == {"turns": 2}
    # the second turn continues the first turn's own tokens, as the chat template renders it all
    assert pool.prompts[1] == episode.token_ids[: len(pool.prompts[1])]
    conversation = [{"role": "user", "content": SAMPLE["question"]},
                    {"role": "assistant", "content": "<answer>50 + 25 - 3</answer>"},
                    {"role": "user", "content": feedback},
                    {"role": "assistant", "content": "<answer>50 + 25</answer>"}]
    assert tokenizer.decode(episode.token_ids) + "\n" == \
        tokenizer.apply_chat_template(conversation, tokenize=False)


@pytest.mark.parametrize(("replies", "reward", "turns", "feedback"), [
    (["<answer>(50 - 25) * 3</answer>"], 1.0, 1, None),
    (["no idea", "<answer>50 + 3</answer>"], 0.1 * 0.9, 2,
     "I found no <answer></answer> tags in your reply. Try again."),
    (["<answer>25 * 3 * 1</answer>", "<answer>50 / (7 - 7)</answer>"], 0.0, 2,
     "Your expression uses numbers you do not have: use each of [3, 3, 25, 50] at most once. "
     "Try again."),
    (["<answer>50 / (3 - 3)</answer>", "<answer>3 - 25</answer>"], 0.1 * 0.9, 2,
     "Your expression divides by zero. Try again."),
    ([("<answer>50 + 3</answer> and then some", "length")], 0.1, 1, None),  # cut off: no retry
])
def test_two_turn_outcomes(ct, tokenizer, runner, replies, reward, turns, feedback):
    episode, segments, _, _ = play(ct, tokenizer, runner, "countdown.two_turn", replies)
    assert episode.reward == pytest.approx(reward) and episode.info["turns"] == turns
    assert [trained for trained, _ in segments] == [False, True] + [False, True] * (turns - 1)
    if feedback is not None:
        assert segments[2][1] == \
            f"\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"
    assert episode.truncated == isinstance(replies[-1], tuple)  # the "length" case


def test_single_turn_and_the_discount_option(ct, tokenizer, runner):
    episode, segments, _, metrics = play(ct, tokenizer, runner, "countdown.single_turn",
                                         ["<answer>50 + 25 * 3</answer>"])
    assert episode.reward == 0.1 and [t for t, _ in segments] == [False, True]
    assert metrics == {"solved": 0.0, "format": 1.0, "numbers_valid": 1.0}
    episode, *_ = play(ct, tokenizer, runner, "countdown.two_turn",
                       ["<answer>3</answer>", "<answer>50+25</answer>"],
                       ct.CountdownConfig(discount=0.5))
    assert episode.reward == 0.5


# ----------------------------------------------------------------------------------- training


def tiny_run(model: Path, rows: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--dataset", str(rows), "--run-dir", str(run_dir),
            "--steps", "2", "--eval-size", "4", "--eval-every", "2", "--rollout.batch-size", "2",
            "--rollout.group-size", "2", "--sampling.max-new-tokens", "8",
            "--inference.dtype", "float32", "--train.dtype", "float32", "--train.optim.lr", "1e-3",
            "--algorithm", "countdown.loo", "--algorithm.clip-eps", "0.3", *extra]


def test_the_generic_recipe_trains_the_plugin_with_its_algorithm_and_shows_its_metrics(
        ct, countdown_site, tiny_model_dir, tmp_path):
    rows = tmp_path / "countdown.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in ct.make_rows(16, seed=1)))
    two = tmp_path / "two_turn"
    result = run_recipe("gsm8k_grpo.py", tiny_run(tiny_model_dir, rows, two, "--workflow",
                                                  "countdown.two_turn"), paths=(countdown_site,))
    # the panel (one line a step off a terminal) shows the plugin's numbers, not GSM8K's
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2
    for name in ("format", "numbers_valid", "solved", "turns"):
        assert all(f" {name} " in line for line in steps), (name, steps)
    assert " eval solved " in steps[1] and "accuracy" not in result.stdout
    trained = [m for m in metrics(two) if m["step"] > 0]
    assert [m["task_metrics"] for m in trained] == [["format", "numbers_valid", "solved",
                                                     "turns"]] * 2
    assert {"eval/solved", "eval/solved_ci_low", "eval/turns"} <= set(trained[1])
    config = (two / "config.yaml").read_text()
    assert "algorithm_name: countdown.loo" in config and "clip_eps: 0.3" in config
    samples = [json.loads(line) for line in (two / "samples.jsonl").read_text().splitlines()]
    assert set(samples[0]["metrics"]) == {"format", "numbers_valid", "solved", "turns"}
    assert samples[0]["info"]["turns"] == samples[0]["metrics"]["turns"]

    # the tiny model never solves one, so every group above was flat; a reward with spread
    # shows LOO's own updates running on the model
    one = tmp_path / "single_turn"
    run_recipe("gsm8k_grpo.py", tiny_run(
        tiny_model_dir, rows, one, "--workflow", "countdown.single_turn", "--reward",
        "tests.rewards_for_tests:completion_length"), paths=(countdown_site,))
    trained = [m for m in metrics(one) if m["step"] > 0]
    assert all(m["train/skipped_rows"] < 4 and m["grad_norm"] > 0 for m in trained), trained
