"""reasoning-gym as data and reward: rows a task's own verifier scores, strict and lenient
grading, eval rows disjoint from training rows, named errors; the Wilson interval of eval
accuracy; the GSM8K grader's strict/lenient split."""

from __future__ import annotations

import builtins
import math
import re
import sys

import pytest

pytest.importorskip("reasoning_gym", reason="pip install 'areal-flow[reasoning-gym]'")
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow import registry
from areal_flow.data import offline
from areal_flow.data import reasoning_gym as rg_data
from areal_flow import rl_recipes
from areal_flow.rl_recipes import RLConfig, wilson_interval
from areal_flow.reward import gsm8k
from areal_flow.reward.reasoning_gym import grade, reasoning_gym
from areal_flow.testing.strategies import completion_text

CHAIN_SUM = "reasoning_gym:chain_sum?min_terms=2&max_terms=3&max_digits=1&size=300"
TASKS = [CHAIN_SUM, "reasoning_gym:leg_counting?size=50",
         "reasoning_gym:spell_backward?size=50", "reasoning_gym:number_sorting?size=50"]


@pytest.fixture(scope="module", params=TASKS)
def task_rows(request):
    return offline.train_eval_rows(request.param, 20)


def test_the_reward_is_registered_through_its_entry_point():
    assert registry.rewards.get("reasoning_gym") is reasoning_gym


def test_each_row_is_a_question_and_the_entry_its_verifier_scores(task_rows):
    train, evaluation, note = task_rows
    for row in train[:10] + evaluation[:10]:
        entry = row["answer"]
        assert row["question"] == entry["question"] and entry["metadata"]["source_dataset"]
        reference = entry["answer"]
        # the reference, written in the ways the docstring promises to read it
        for completion in (reference, f"{reference}.", f"<answer>{reference}</answer>",
                           f"Let me think.\n{reference}"):
            assert reasoning_gym(completion, answer=entry) == 1.0, completion
            assert grade(completion, entry) == {"accuracy": 1.0, "accuracy_lenient": 1.0,
                                                "format": 1.0}
    assert f"{len(train):,} train rows" in note and f"{len(evaluation):,} distinct" in note


def test_a_wrong_answer_and_a_malformed_completion_are_not_correct(task_rows):
    train, _, _ = task_rows
    entry, other = train[0]["answer"], next(
        r["answer"] for r in train if r["answer"]["answer"] != train[0]["answer"]["answer"])
    wrong = f"The answer is {other['answer']}"
    assert grade(wrong, entry)["accuracy"] == 0.0
    assert reasoning_gym(wrong, answer=entry) < 1.0
    for malformed in ("", "   \n", "<answer></answer>", "\x00\ufffd", "I don't know"):
        assert reasoning_gym(malformed, answer=entry) < 1.0
        assert grade(malformed, entry)["accuracy"] == 0.0


def test_the_numeric_answer_is_the_last_number_and_lenient_finds_it_anywhere():
    train, _, _ = offline.train_eval_rows(CHAIN_SUM, 5)
    entry = train[0]["answer"]
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    assert grade(f"It is {wrong}, no: {right}.", entry)["accuracy"] == 1.0
    # the right number followed by another: strict reads the last one, lenient sees the first
    assert grade(f"{right}, so {wrong}", entry) == {"accuracy": 0.0, "accuracy_lenient": 1.0,
                                                    "format": 1.0}
    assert grade("no number here", entry)["format"] == 0.0


def test_lenient_finds_a_one_word_answer_inside_a_sentence():
    train, _, _ = offline.train_eval_rows("reasoning_gym:syllogism?size=20", 5)
    entry = train[0]["answer"]
    assert grade(f"{entry['answer']}, because of the first statement.", entry) == {
        "accuracy": 0.0, "accuracy_lenient": 1.0, "format": 1.0}


@settings(max_examples=150, deadline=None)
@given(completion=completion_text(), index=st.integers(0, 19))
def test_the_reward_takes_any_text_and_scores_it_deterministically_in_range(completion, index):
    entry = ROWS_FOR_PROPERTY[index]["answer"]
    score = reasoning_gym(completion, answer=entry)
    assert 0.0 <= score <= 1.0 and score == reasoning_gym(completion, answer=entry)
    graded = grade(completion, entry)
    assert graded["accuracy"] <= graded["accuracy_lenient"]


ROWS_FOR_PROPERTY = offline.train_eval_rows("reasoning_gym:leg_counting?size=10", 10)[0] + \
    offline.train_eval_rows(CHAIN_SUM, 10)[0][:10]


def test_a_reasoning_gym_dataset_brings_its_reward_and_its_panel_metrics_to_the_recipes():
    config = RLConfig(dataset=CHAIN_SUM)
    assert rl_recipes.workflow_config(config).reward == "reasoning_gym"
    assert registry.rewards.spec("reasoning_gym").metrics is grade
    assert rl_recipes.workflow_config(RLConfig()).reward == "gsm8k"
    assert registry.rewards.spec("gsm8k").metrics is gsm8k.grade


def test_eval_rows_are_distinct_held_out_problems_from_another_seed():
    train, evaluation, _ = offline.train_eval_rows(CHAIN_SUM, 200)
    questions = [row["question"] for row in evaluation]
    assert len(evaluation) == 200 and len(set(questions)) == 200
    assert not set(questions) & {row["question"] for row in train}
    # reasoning-gym draws problem i from Random(seed + i): seed + 1 would repeat training rows
    shifted = rg_data._create("chain_sum", {"min_terms": 2, "max_terms": 3, "max_digits": 1},
                              size=10, seed=1)
    assert shifted[0]["question"] == train[1]["question"]


def test_an_eval_set_skewed_by_skipping_training_questions_is_warned_about():
    # 2-3 terms: training (2,000 rows) holds nearly all 300 two-term problems, so eval loses them
    small = "reasoning_gym:basic_arithmetic?min_terms=2&max_terms=3&max_digits=1" \
            "&operators=['+','-','*']&allow_parentheses=false&allow_negation=false"
    train, evaluation, note = offline.train_eval_rows(f"{small}&size=2000", 200)
    two_terms = [sum(r["answer"]["metadata"]["num_terms"] == 2 for r in rows) / len(rows)
                 for rows in (train, evaluation)]
    assert two_terms[0] > 0.4 and two_terms[1] < 0.1
    assert re.search(r"WARNING: \d+% of the problems drawn for eval were training questions", note)
    assert "WARNING" not in offline.train_eval_rows(f"{small}&size=50", 200)[2]


def test_a_task_too_small_for_a_disjoint_eval_set_is_refused_with_the_counts():
    # 1-digit sums of two terms: 200 distinct questions at most, all drawn for training
    with pytest.raises(ValueError, match=r"only \d+ of --eval-size 100 .* distinct from the 5,000"):
        offline.train_eval_rows("reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=1"
                                "&size=5000", 100)


def test_config_values_are_yaml_scalars_and_a_plus_is_a_plus():
    assert rg_data.parse("reasoning_gym:basic_arithmetic?operators=['+','-']&max_terms=2"
                         "&allow_negation=false") == (
        "basic_arithmetic", {"operators": ["+", "-"], "max_terms": 2, "allow_negation": False})
    with pytest.raises(ValueError, match="'max_terms' is not key=value"):
        rg_data.parse("reasoning_gym:chain_sum?max_terms")


@pytest.mark.parametrize("spec, message", [
    ("reasoning_gym:chain_summ", "no such reasoning-gym task; tasks: .*chain_sum"),
    ("reasoning_gym:chain_sum?max_term=3", r"unknown config key\(s\) \['max_term'\].*max_terms"),
    ("reasoning_gym:chain_sum?min_terms=5&max_terms=2", "invalid config .*max_terms"),
])
def test_bad_task_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        offline.train_eval_rows(spec, 4)


def test_a_missing_package_names_the_install_command(monkeypatch):
    real_import = builtins.__import__

    def no_reasoning_gym(name, *args, **kwargs):
        if name.split(".")[0] == "reasoning_gym":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "reasoning_gym", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_reasoning_gym)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'areal-flow\[reasoning-gym\]'"):
        offline.train_eval_rows(CHAIN_SUM, 4)


def test_the_gsm8k_grader_separates_the_read_answer_from_the_number_anywhere():
    assert gsm8k.grade("18 eggs... #### 18", "#### 18") == {
        "accuracy": 1.0, "accuracy_lenient": 1.0, "format": 1.0, "work_shown": 0.0}
    assert gsm8k.grade("she has 9 + 9 = 18, so #### 20", "#### 18") == {
        "accuracy": 0.0, "accuracy_lenient": 1.0, "format": 1.0, "work_shown": 1.0}
    assert gsm8k.grade("I think 7", "#### 18") == {
        "accuracy": 0.0, "accuracy_lenient": 0.0, "format": 0.0, "work_shown": 0.0}


# The Wilson interval is the set of p that a two-sided score test at level 5% does not reject:
# |k/n - p| <= z * sqrt(p (1 - p) / n). Its bounds are found here by bisection on that
# inequality, independently of the closed form under test.
Z95 = 1.959963984540054


def _score_test_bound(k: int, n: int, upper: bool) -> float:
    accepted = lambda p: abs(k / n - p) <= Z95 * math.sqrt(p * (1 - p) / n)  # noqa: E731
    inside, outside = k / n, (1.0 if upper else 0.0)
    if accepted(outside):
        return outside
    for _ in range(100):
        middle = (inside + outside) / 2
        inside, outside = (middle, outside) if accepted(middle) else (inside, middle)
    return inside


@given(n=st.integers(1, 2000), data=st.data())
def test_the_wilson_interval_is_the_score_tests_acceptance_region(n, data):
    k = data.draw(st.integers(0, n))
    low, high = wilson_interval(k, n)
    assert low == pytest.approx(_score_test_bound(k, n, upper=False), abs=1e-9)
    assert high == pytest.approx(_score_test_bound(k, n, upper=True), abs=1e-9)


def test_the_wilson_interval_matches_published_values():
    # Newcombe (1998), Statistics in Medicine 17:857, Table II, method 3 (score, no correction)
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson_interval(15, 148) == pytest.approx((0.0624, 0.1605), abs=1e-4)
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)
    assert wilson_interval(1, 29) == pytest.approx((0.0061, 0.1718), abs=1e-4)
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)
