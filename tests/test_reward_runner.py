"""Rewards run contained: hung, crashing, raising and out-of-range rewards score their default,
are counted, and the pool recovers for the next call."""

from __future__ import annotations

import asyncio

import pytest

from areal_flow.reward.runner import FAILURE_WINDOW, RewardFailureError, RewardRunner
from tests import rewards_for_tests


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(max_workers=2) as r:
        yield r


def score(runner, name, text="abc"):
    return asyncio.run(runner.score(name, text))


@pytest.mark.parametrize(
    ("name", "counter", "default"),
    [
        ("tests.sleeps_forever", "timeouts", 0.0),
        ("tests.kills_itself", "crashes", 0.0),
        ("tests.raises", "errors", 0.25),
        ("tests.out_of_range", "invalid", 0.0),
        ("tests.async_hangs", "timeouts", 0.5),
    ],
)
def test_a_misbehaving_reward_scores_its_default_and_the_next_call_is_true(
    runner, name, counter, default
):
    runner.stats()
    assert score(runner, name) == default
    assert score(runner, "tests.length", "hello") == 5.0  # the pool recovered
    stats = runner.stats()
    assert stats[counter] == 1 and stats["calls"] == 2
    others = {"timeouts", "crashes", "errors", "invalid"} - {counter}
    assert all(stats[k] == 0 for k in others)


def test_rewards_run_in_light_worker_processes(runner):
    # the parent has torch loaded (the test session imports it); the workers must not (pytest's
    # main script does not import it; a recipe's does: the gap in docs/architecture.md)
    import torch  # noqa: F401

    assert score(runner, "tests.imports_torch") == 0.0


def test_rewards_are_named_by_registry_name_function_or_path(runner):
    assert asyncio.run(runner.score(rewards_for_tests.length, "four")) == 4.0
    assert asyncio.run(runner.score("tests.rewards_for_tests:length", "xy")) == 2.0
    assert asyncio.run(runner.score("tests.async_ok", "x")) == 1.0
    assert asyncio.run(runner.score("gsm8k", "#### 12", answer="12")) == 1.0


def test_many_concurrent_calls_all_return(runner):
    async def main():
        return await asyncio.gather(*(runner.score("tests.length", "x" * i) for i in range(40)))

    assert asyncio.run(main()) == [float(i) for i in range(40)]


def test_a_reward_defined_in_a_script_gets_a_clear_error(runner):
    def local(completion):
        return 1.0

    with pytest.raises(ValueError, match="cannot be imported by a worker process"):
        asyncio.run(runner.score(local, "x"))


def test_a_reward_that_cannot_take_the_arguments_fails_instead_of_scoring_its_default(runner):
    runner.stats()
    with pytest.raises(TypeError, match=r"reward 'tests.length' cannot take .*\['answer'\]"):
        asyncio.run(runner.score("tests.length", "abc", answer="12"))
    assert runner.stats()["calls"] == 0  # nothing was sent to a worker


@pytest.mark.faults
def test_a_reward_failing_on_most_calls_stops_instead_of_scoring_defaults():
    """Every call failing: defaults until half a window of calls, then an error that names the
    reward, the rate and the last failure; the failure rate is in stats()."""
    judged = FAILURE_WINDOW // 2
    with RewardRunner(max_workers=1) as r:
        async def calls(n):
            return [await r.score("tests.fails_on_x", "x") for _ in range(n)]

        assert asyncio.run(calls(judged - 1)) == [0.0] * (judged - 1)
        with pytest.raises(RewardFailureError,
                           match=rf"'tests.fails_on_x' failed on {judged} of its last {judged} "
                                 r"calls.*50%.*error: ValueError\('an x'\)"):
            asyncio.run(calls(1))
        assert r.stats()["failure_rate"] == 1.0


@pytest.mark.faults
def test_failures_below_the_limit_score_defaults_and_never_stop():
    texts = ["x" if i % 3 == 0 else "ok" for i in range(2 * FAILURE_WINDOW)]  # a third fail
    with RewardRunner(max_workers=1, max_failure_rate=0.4) as r:
        async def calls():
            return [await r.score("tests.fails_on_x", t) for t in texts]

        assert asyncio.run(calls()) == [0.0 if t == "x" else 1.0 for t in texts]
        assert r.stats()["failure_rate"] == pytest.approx(texts.count("x") / len(texts))
    with pytest.raises(ValueError, match="max_failure_rate"):
        RewardRunner(max_failure_rate=1.5)
