"""The built-in gsm8k reward: the reward contract, every supported answer format, and the
preference order between formats."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_flow import rewards
from areal_flow.reward.gsm8k import extract_answer, gsm8k, shows_work
from areal_flow.testing.contract import check_reward
from areal_flow.testing.strategies import formatted_numbers
from tests.helpers import run_cli

# Text before the answer; it may hold other numbers but no competing answer marker.
noise = st.text(max_size=60).filter(lambda t: "####" not in t and "boxed" not in t)
FORMATS = [
    "{noise} #### {written}",
    "{noise} so the answer is \\boxed{{{written}}}",
    "{noise}\nThe answer is {written}.",
]


def test_gsm8k_is_a_builtin_announced_through_entry_points():
    listing = run_cli("plugins").stdout
    row = next(line for line in listing.splitlines() if " gsm8k " in line)
    assert [c.strip() for c in row.strip("│ ").split("│")] == [
        "reward", "gsm8k", "areal-flow 0.1.0", "areal_flow.reward.gsm8k:gsm8k"
    ]
    assert rewards.get("gsm8k") is gsm8k


def test_gsm8k_passes_the_reward_contract():
    report = check_reward("gsm8k", max_examples=300)
    assert report.ok, report.summary()


@given(number=formatted_numbers(), noise=noise, fmt=st.sampled_from(FORMATS),
       gsm8k_style_reference=st.booleans())
def test_the_right_number_in_any_supported_format_scores_one(
    number, noise, fmt, gsm8k_style_reference
):
    canonical, written = number
    answer = f"Some worked solution, 3 + 4 = 7.\n#### {canonical}" if gsm8k_style_reference \
        else canonical
    assert gsm8k(fmt.format(noise=noise, written=written), answer=answer) == 1.0


@given(number=formatted_numbers(), other=formatted_numbers(), noise=noise,
       fmt=st.sampled_from(FORMATS))
def test_a_different_number_scores_zero(number, other, noise, fmt):
    canonical, _ = number
    other_canonical, other_written = other
    if Decimal(other_canonical) == Decimal(canonical):
        return
    assert gsm8k(fmt.format(noise=noise, written=other_written), answer=canonical) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 apples and \\boxed{4}, #### 5", "5"),  # #### beats boxed and last number
        ("\\boxed{4} and then 9 more", "4"),  # boxed beats last number
        ("#### (no number) but \\boxed{6}", "6"),  # a marker without a number falls through
        ("first 1,234 then 7.", "7"),
        ("$1,234.00", "1234"),
        ("it grew by 50%", "50"),
        ("owes -$12", "-12"),
        ("no digits here", None),
        ("Arabic-Indic ٣ is not an ASCII digit", None),
    ],
)
def test_answer_extraction_follows_the_documented_preference(text, expected):
    found = extract_answer(text)
    assert found == (None if expected is None else Decimal(expected))


def test_the_format_component_is_weighted_in():
    assert gsm8k("#### 72", answer="72", format_weight=0.2) == 1.0
    assert gsm8k("It is 72.", answer="72", format_weight=0.2) == pytest.approx(0.8)
    assert gsm8k("#### 71", answer="72", format_weight=0.2) == pytest.approx(0.2)
    assert gsm8k("71", answer="72", format_weight=0.2) == 0.0


@pytest.mark.parametrize(("text", "worked"), [
    ("8 * 9 = 72. #### 72", True),
    ("8 bags of 9: 8 x 9 = 72 apples", True),
    ("She pays $3 + $4 = $7 in all.", True),
    ("12/4=3, so 3", True),
    ("#### 72", False),
    ("72", False),
    ("#### 72 because 8 * 9 = 72", False),  # the work must come before the answer
    ("8 * 9 is a lot. #### 72", False),  # an expression without its result
    ("the years 2019-2020 = a long time", False),
])
def test_shown_work_is_a_calculation_before_the_answer(text, worked):
    assert shows_work(text) is worked
    assert gsm8k(text, answer="72", require_work=True) == float(worked and "72" in text)


def test_with_required_work_the_format_credit_needs_a_calculation_too():
    kwargs = {"answer": "72", "format_weight": 0.2, "require_work": True}
    assert gsm8k("#### 71", **kwargs) == 0.0  # a bare '#### N' earns nothing
    assert gsm8k("#### 72", **kwargs) == 0.0
    assert gsm8k("8 * 9 = 71. #### 71", **kwargs) == pytest.approx(0.2)  # format and work
    assert gsm8k("8 * 9 = 72. #### 72", **kwargs) == 1.0
    assert gsm8k("8 * 9 = 72 apples", **kwargs) == pytest.approx(0.8)  # right, no '#### N'


def test_the_recipes_default_reward_pays_for_a_right_answer_after_shown_work_and_a_little_for_the_form():
    from areal_flow import registry, rl_recipes
    from areal_flow.rl_recipes import RLConfig

    config = rl_recipes.workflow_config(RLConfig())
    score = registry.rewards.get(config.reward)
    reference = "She has 8 bags of 9. 8 * 9 = 72. #### 72"
    for unearned in ("#### 71", "#### 72", "72", "8 * 9 = 71, so 71"):
        assert score(unearned, answer=reference, **config.reward_kwargs) == 0.0, unearned
    # the form alone: a calculation, then '#### N' with the wrong N
    assert score("8 * 9 = 71. #### 71", answer=reference, **config.reward_kwargs) == \
        pytest.approx(0.1)
    assert score("8 * 9 = 72. #### 72", answer=reference, **config.reward_kwargs) == 1.0
    assert score("8 bags of 9 make 8 * 9 = 72 apples.", answer=reference,
                 **config.reward_kwargs) == pytest.approx(0.9)
