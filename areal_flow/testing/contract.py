"""The reward contract every reward must pass, runnable by third parties.

A reward never raises on arbitrary text, returns a finite real number within its declared
`range`, is deterministic, and returns within its `timeout`. Its `metrics`, if it declares them,
are checked on the same examples: never raise, return {plain name: finite number} (what the
reward runner accepts: anything else is counted as a failure of the reward), deterministic,
within the reward's timeout. Examples are hostile text with the
keyword arguments the reward requires drawn from their type annotations (text when there is
none), or a strategy of ``(completion, kwargs)`` pairs the caller gives — e.g.
`strategies.answered`, whose completions state an answer in the syntaxes rewards parse, so the
check reaches a reward's main path. Calls run in this process, each in a thread it waits on
for the reward's timeout: a reward that hangs fails the check then.
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
import time
import typing
from typing import Any

import anyio
import attrs
try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis import strategies as st
except ImportError:
    raise ModuleNotFoundError("the reward contract kit generates its cases with hypothesis: pip "
                              "install 'areal-flow[contract]'") from None

from areal_flow.registry import rewards
from areal_flow.reward.runner import metrics_problem
from areal_flow.testing.strategies import completion_text
from areal_flow.types import RewardSpec


class ContractViolation(AssertionError):
    pass


class _TimedOut(BaseException):
    """A call overran the timeout: not an Exception, so hypothesis stops at once instead of
    shrinking (which would wait out the timeout again for every smaller example)."""


@attrs.frozen
class ContractReport:
    name: str
    examples: int
    slowest_s: float
    timeout_s: float
    failure: str | None
    metrics_checked: bool = False
    """Whether the reward declares `metrics`, checked on the same examples."""

    @property
    def ok(self) -> bool:
        return self.failure is None

    def summary(self) -> str:
        verdict = "passed" if self.ok else f"FAILED\n{self.failure}"
        return (
            f"reward {self.name!r}: {verdict}\n"
            f"  examples run: {self.examples}"
            f"{' (the reward and its metrics)' if self.metrics_checked else ''}; "
            f"slowest call {self.slowest_s * 1e3:.2f} ms "
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


def _call(fn: Any, timeout: float, completion: str, kwargs: dict[str, Any]) -> Any:
    """`fn`'s value, or raises what it raised, or `_TimedOut` past `timeout` (the call is left
    running in a daemon thread, which dies with the process)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            if inspect.iscoroutinefunction(fn):
                box["value"] = anyio.run(lambda: fn(completion, **kwargs))
            else:
                box["value"] = fn(completion, **kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="reward-contract-call")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _TimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


def check_reward(reward: str | RewardSpec, *, max_examples: int = 200,
                 examples: st.SearchStrategy[tuple[str, dict[str, Any]]] | None = None,
                 seed: int | None = None) -> ContractReport:
    """Run the reward contract on a registered name or a spec and report the outcome.
    `examples` draws ``(completion, kwargs)`` pairs (default: hostile text, and kwargs from the
    reward's signature); the failure names the property and the smallest example found.
    `seed`: None draws new examples each run (more of the space over many runs); a
    number draws the same ones every run (a CI check that cannot flicker, a failure to
    reproduce)."""
    spec = rewards.spec(reward) if isinstance(reward, str) else reward
    lo, hi = spec.range
    seen: dict[str, Any] = {"examples": 0, "slowest": 0.0, "timed_out": None}

    def timed_call(fn: Any, shown: str, completion: str, kwargs: dict[str, Any]) -> Any:
        start = time.perf_counter()
        try:
            value = _call(fn, spec.timeout, completion, kwargs)
        except _TimedOut:
            seen["timed_out"] = (f"property 'returns within its timeout': {shown} did not "
                                 f"return within {spec.timeout:g} s")
            raise
        except Exception as exc:
            raise ContractViolation(f"property 'never raises': {shown} raised "
                                    f"{type(exc).__name__}: {exc}") from exc
        seen["slowest"] = max(seen["slowest"], time.perf_counter() - start)
        return value

    def one_call(completion: str, kwargs: dict[str, Any]) -> Any:
        shown = f"{spec.name}({completion!r}, **{kwargs!r})"
        score = timed_call(spec.fn, shown, completion, kwargs)
        if isinstance(score, bool) or not isinstance(score, numbers.Real):
            raise ContractViolation(f"property 'returns a real number': {shown} returned "
                                    f"{score!r}")
        if not math.isfinite(score):
            raise ContractViolation(f"property 'returns a finite number': {shown} returned "
                                    f"{score!r}")
        if not lo <= score <= hi:
            raise ContractViolation(f"property 'stays within its range {spec.range}': {shown} "
                                    f"returned {score!r}")
        return score

    def metrics_call(completion: str, kwargs: dict[str, Any]) -> Any:
        # the runner calls `metrics` with the reward's own arguments, after every score
        shown = f"metrics of {spec.name}({completion!r}, **{kwargs!r})"
        found = timed_call(spec.metrics, shown, completion, kwargs)
        problem = metrics_problem(found)
        if problem is not None:
            raise ContractViolation(f"property 'metrics are named numbers': {shown}: {problem}")
        return found

    default = st.tuples(completion_text(), _kwargs_strategy(spec.fn))

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(example=default if examples is None else examples)
    def contract(example: tuple[str, dict[str, Any]]) -> None:
        completion, kwargs = example
        seen["examples"] += 1
        first, second = one_call(completion, kwargs), one_call(completion, kwargs)
        if first != second:
            raise ContractViolation(
                f"property 'deterministic': {spec.name}({completion!r}, **{kwargs!r}) returned "
                f"{first!r} then {second!r}"
            )
        if spec.metrics is not None:
            first, second = metrics_call(completion, kwargs), metrics_call(completion, kwargs)
            if first != second:
                raise ContractViolation(
                    f"property 'deterministic': metrics of {spec.name}({completion!r}, "
                    f"**{kwargs!r}) returned {first!r} then {second!r}")

    if seed is not None:
        contract = fixed_seed(seed)(contract)
    failure = None
    try:
        contract()
    except ContractViolation as exc:
        failure = str(exc)
    except _TimedOut:
        failure = seen["timed_out"]
    return ContractReport(spec.name, seen["examples"], seen["slowest"], spec.timeout, failure,
                          metrics_checked=spec.metrics is not None)


def assert_reward_contract(reward: str | RewardSpec, *, max_examples: int = 200,
                           examples: st.SearchStrategy[tuple[str, dict[str, Any]]] | None = None,
                           seed: int | None = None) -> ContractReport:
    """`check_reward`, raising `ContractViolation` with the smallest failing example."""
    report = check_reward(reward, max_examples=max_examples, examples=examples,
                          seed=seed)
    if not report.ok:
        raise ContractViolation(report.summary())
    return report
