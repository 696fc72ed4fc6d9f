"""The reward contract every reward must pass, runnable by third parties.

A reward never raises on arbitrary text, returns a finite real number within its declared
`range`, and is deterministic. Keyword arguments the reward requires are drawn from their type
annotations (text when there is none). Calls run in this process; containing rewards that hang
or crash is the reward runner's job, so the report shows the slowest call against the timeout.
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
import typing
from typing import Any

import anyio
import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_flow.registry import rewards
from areal_flow.testing.strategies import completion_text
from areal_flow.types import RewardSpec


class ContractViolation(AssertionError):
    pass


@attrs.frozen
class ContractReport:
    name: str
    examples: int
    slowest_s: float
    timeout_s: float
    failure: str | None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def summary(self) -> str:
        verdict = "passed" if self.ok else f"FAILED\n{self.failure}"
        return (
            f"reward {self.name!r}: {verdict}\n"
            f"  examples run: {self.examples}; slowest call {self.slowest_s * 1e3:.2f} ms "
            f"(timeout {self.timeout_s:g} s)"
        )


def _kwargs_strategy(fn: Any) -> st.SearchStrategy[dict[str, Any]]:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolved forward references: fall back to text for everything
        hints = {}
    params = list(inspect.signature(fn).parameters.values())[1:]  # the first is the completion
    required = {
        p.name: (st.from_type(hints[p.name]) if p.name in hints else completion_text())
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    return st.fixed_dictionaries(required)


def _call(spec: RewardSpec, completion: str, kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(spec.fn):
        return anyio.run(lambda: spec.fn(completion, **kwargs))
    return spec.fn(completion, **kwargs)


def check_reward(reward: str | RewardSpec, *, max_examples: int = 200) -> ContractReport:
    """Run the reward contract on a registered name or a spec and report the outcome."""
    spec = rewards.get(reward) if isinstance(reward, str) else reward
    lo, hi = spec.range
    seen = {"examples": 0, "slowest": 0.0}

    def one_call(completion: str, kwargs: dict[str, Any]) -> Any:
        shown = f"{spec.name}({completion!r}, **{kwargs!r})"
        start = time.perf_counter()
        try:
            score = _call(spec, completion, kwargs)
        except Exception as exc:
            raise ContractViolation(f"{shown} raised {type(exc).__name__}: {exc}") from exc
        seen["slowest"] = max(seen["slowest"], time.perf_counter() - start)
        if isinstance(score, bool) or not isinstance(score, numbers.Real):
            raise ContractViolation(f"{shown} returned {score!r}, not a real number")
        if not math.isfinite(score):
            raise ContractViolation(f"{shown} returned {score!r}, which is not finite")
        if not lo <= score <= hi:
            raise ContractViolation(f"{shown} returned {score!r}, outside its range {spec.range}")
        return score

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(completion=completion_text(), kwargs=_kwargs_strategy(spec.fn))
    def contract(completion: str, kwargs: dict[str, Any]) -> None:
        seen["examples"] += 1
        first, second = one_call(completion, kwargs), one_call(completion, kwargs)
        if first != second:
            raise ContractViolation(
                f"{spec.name}({completion!r}, **{kwargs!r}) is not deterministic: "
                f"{first!r} then {second!r}"
            )

    failure = None
    try:
        contract()
    except ContractViolation as exc:
        failure = str(exc)
    if failure is None and seen["slowest"] > spec.timeout:
        failure = f"a call took {seen['slowest']:.3f} s, over the reward's timeout {spec.timeout} s"
    return ContractReport(spec.name, seen["examples"], seen["slowest"], spec.timeout, failure)


def assert_reward_contract(reward: str | RewardSpec, *, max_examples: int = 200) -> ContractReport:
    """`check_reward`, raising `ContractViolation` with the smallest failing example."""
    report = check_reward(reward, max_examples=max_examples)
    if not report.ok:
        raise ContractViolation(report.summary())
    return report
