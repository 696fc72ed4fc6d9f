"""The reward contract catches each kind of broken reward, passes good ones, and works as a
pytest plugin and from `areal-flow check-reward`."""

from __future__ import annotations

import itertools
from decimal import Decimal

import pytest
from hypothesis import given

from areal_flow.testing.contract import ContractViolation, assert_reward_contract, check_reward
from areal_flow.testing.strategies import completion_text, formatted_numbers
from areal_flow.types import RewardSpec
from tests.helpers import run_cli


def spec(fn, **kwargs) -> RewardSpec:
    return RewardSpec(name=fn.__name__, fn=fn, **kwargs)


def good(completion: str, *, answer: str) -> float:
    return float(answer in completion)


async def good_async(completion: str) -> float:
    return 0.25


def raises_on_digits(completion: str) -> float:
    if any(c.isdigit() for c in completion):
        raise ValueError("cannot parse")
    return 0.0


def out_of_range(completion: str) -> float:
    return 1.0 + len(completion)


def not_finite(completion: str) -> float:
    return float("nan") if completion else 0.0


def returns_text(completion: str) -> str:
    return "1"


_counter = itertools.count()


def nondeterministic(completion: str) -> float:
    return next(_counter) % 2


def typed_kwargs(completion: str, *, answer: int, tolerance: float = 0.0) -> float:
    assert isinstance(answer, int)  # drawn from the annotation, not as text
    return 0.0


@pytest.mark.parametrize("fn", [good, good_async, typed_kwargs])
def test_good_rewards_pass(fn):
    report = check_reward(spec(fn), max_examples=50)
    assert report.ok, report.summary()
    assert report.examples == 50


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (raises_on_digits, "raised ValueError: cannot parse"),
        (out_of_range, "outside its range (0.0, 1.0)"),
        (not_finite, "which is not finite"),
        (returns_text, "returned '1', not a real number"),
        (nondeterministic, "is not deterministic"),
    ],
)
def test_each_kind_of_broken_reward_is_caught(fn, expected):
    report = check_reward(spec(fn), max_examples=100)
    assert not report.ok
    assert expected in report.failure
    with pytest.raises(ContractViolation, match="FAILED"):
        assert_reward_contract(spec(fn), max_examples=100)


def test_the_range_the_reward_declares_is_the_one_checked():
    assert check_reward(spec(out_of_range, range=(1.0, 1e9), default=1.0), max_examples=30).ok


@given(formatted_numbers())
def test_formatted_numbers_write_the_canonical_value(pair):
    canonical, written = pair
    plain = written.replace(",", "").replace("$", "").replace("%", "")
    assert Decimal(plain) == Decimal(canonical)


@given(completion_text())
def test_completion_text_is_text(text):
    assert isinstance(text, str)


def test_the_pytest_plugin_gives_third_parties_a_fixture(pytester):
    pytester.makepyfile(
        """
        from areal_flow.types import RewardSpec

        def exact(completion, *, answer: str):
            return float(completion.strip() == answer)

        def broken(completion):
            return 2.0

        def test_exact(reward_contract):
            reward_contract(RewardSpec(name="exact", fn=exact), max_examples=20)

        def test_broken(reward_contract):
            reward_contract(RewardSpec(name="broken", fn=broken), max_examples=20)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*outside its range*"])


def test_check_reward_command_reports_and_sets_the_exit_code(example_plugin_path):
    ok = run_cli("check-reward", "reverse.exact", "--max-examples", "50",
                 paths=(example_plugin_path,))
    assert "reward 'reverse.exact': passed" in ok.stdout
    bad = run_cli("check-reward", "tests.test_reward_contract:out_of_range", check=False)
    assert bad.returncode == 1 and "FAILED" in bad.stdout
    unknown = run_cli("check-reward", "reverse.exakt", paths=(example_plugin_path,), check=False)
    assert unknown.returncode == 2 and "Did you mean 'reverse.exact'?" in unknown.stdout
