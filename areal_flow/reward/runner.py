"""Runs rewards so that a bad one can never stall training.

Sync rewards run in worker processes (pebble, started by ``forkserver``: never ``fork`` from a
process running torch and threads). A call past its reward's `timeout` has its worker killed and
replaced; a worker that dies (segfault, ``os._exit``, SIGKILL) is replaced too; an exception or
an out-of-range or non-finite score is an error. Each of these scores the reward's `default` and
is counted in `stats()`. Async rewards are awaited in the caller's loop under the same timeout.
A reward that fails on more than `max_failure_rate` of its recent calls raises
`RewardFailureError` instead: a run whose rewards are mostly defaults is not training on rewards.

Workers resolve rewards by registry name ("package.module:function"): a reward needs nothing of
the caller's but its own module (multiprocessing still imports the caller's main script in each
worker; see docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing
import numbers
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from pebble import ProcessExpired, ProcessPool

from areal_flow.registry import SPEC_ATTR, rewards
from areal_flow.types import RewardSpec

log = logging.getLogger(__name__)


def resolve(reward: str | Callable[..., Any] | RewardSpec) -> RewardSpec:
    """A reward given by registered name, spec, or function (decorated or plain)."""
    if isinstance(reward, RewardSpec):
        return reward
    if isinstance(reward, str):
        return rewards.get(reward)
    spec = getattr(reward, SPEC_ATTR, None)
    if isinstance(spec, RewardSpec) and spec.fn is reward:
        return spec
    return RewardSpec(name=getattr(reward, "__qualname__", repr(reward)), fn=reward)


def _importable_path(spec: RewardSpec) -> str:
    module, qualname = spec.fn.__module__, spec.fn.__qualname__
    if module == "__main__" or "<locals>" in qualname:
        raise ValueError(
            f"reward {spec.name!r} ({module}:{qualname}) cannot be imported by a worker process; "
            "define it at the top level of a module (or make it async to run it in-process)"
        )
    return f"{module}:{qualname}"


def _call_in_worker(path: str, args: tuple, kwargs: dict) -> Any:
    return rewards.get(path).fn(*args, **kwargs)


class RewardFailureError(RuntimeError):
    """A reward failed on too many of its recent calls to be trusted."""


FAILURE_WINDOW = 64
"""A reward's failure rate is taken over its last this-many calls, once it has half as many."""


class RewardRunner:
    """Scores completions with registered rewards; see the module docstring for the guarantees.

    Args:
        max_workers: worker processes for sync rewards.
        max_failure_rate: a reward failing (timeout, crash, error, out of range) on more than
            this fraction of its last `FAILURE_WINDOW` calls raises `RewardFailureError` from
            then on; 1 never does.
    """

    def __init__(self, max_workers: int = 2, max_failure_rate: float = 0.5):
        if max_workers < 1:
            raise ValueError(f"'max_workers' must be >= 1: {max_workers}")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(f"'max_failure_rate' must be in [0, 1]: {max_failure_rate}")
        self.max_failure_rate = max_failure_rate
        self._recent: dict[str, deque[bool]] = {}
        context = multiprocessing.get_context("forkserver")
        # Preloaded once in the forkserver, so a new worker starts in a fraction of a second
        # (each still imports the caller's main script: the gap in docs/architecture.md).
        context.set_forkserver_preload(["areal_flow"])
        self._pool = ProcessPool(max_workers=max_workers, context=context)
        self._counts: Counter[str] = Counter()
        self._seconds = 0.0
        self._lock = threading.Lock()

    async def score(self, reward: str | Callable[..., Any] | RewardSpec, *args, **kwargs) -> float:
        """The reward's score, or its `default` if it raised, crashed, hung or went out of range."""
        spec = resolve(reward)
        try:  # a signature mismatch is the caller's bug, not a bad completion: never a default
            inspect.signature(spec.fn).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"reward {spec.name!r} cannot take the arguments it is called with "
                            f"({exc}); accept them (e.g. **kwargs) or pick another reward: "
                            f"keywords {sorted(kwargs)}") from None
        is_async = inspect.iscoroutinefunction(spec.fn)
        path = None if is_async else _importable_path(spec)
        start = time.perf_counter()
        try:
            if is_async:
                value = await asyncio.wait_for(spec.fn(*args, **kwargs), spec.timeout)
            else:
                future = self._pool.schedule(_call_in_worker, args=(path, args, kwargs),
                                             timeout=spec.timeout)
                value = await asyncio.wrap_future(future)
            outcome = "ok" if _in_range(value, spec) else "invalid"
        except TimeoutError:  # the worker was killed and is being replaced
            outcome = "timeout"
        except ProcessExpired:  # the worker died; pebble starts a new one
            outcome = "crash"
        except Exception as exc:
            outcome, value = "error", exc
        with self._lock:  # stats() is read from the trainer thread
            self._seconds += time.perf_counter() - start
            self._counts["calls"] += 1
            self._counts[outcome] += 1
            recent = self._recent.setdefault(spec.name, deque(maxlen=FAILURE_WINDOW))
            recent.append(outcome != "ok")
            failed, judged = sum(recent), len(recent)
        if outcome == "ok":
            return float(value)
        what = f"{outcome}: {value!r}" if outcome in ("error", "invalid") else \
            f"{outcome} (its {spec.timeout} s limit)" if outcome == "timeout" else outcome
        if judged >= FAILURE_WINDOW // 2 and failed > self.max_failure_rate * judged:
            raise RewardFailureError(
                f"reward {spec.name!r} failed on {failed} of its last {judged} calls, more "
                f"than the limit of {self.max_failure_rate:.0%} (--reward-failure-limit); last "
                f"failure: {what}. Fix the reward, or raise the limit (1 never stops)")
        log.warning("reward %r: %s; scored its default %s", spec.name, what, spec.default)
        return spec.default

    def stats(self) -> dict[str, float]:
        """Calls and failures since the last call."""
        with self._lock:
            counts, seconds = self._counts, self._seconds
            self._counts, self._seconds = Counter(), 0.0
        calls = counts["calls"]
        return {
            "calls": calls,
            "timeouts": counts["timeout"],
            "crashes": counts["crash"],
            "errors": counts["error"],
            "invalid": counts["invalid"],
            "failure_rate": (calls - counts["ok"]) / calls if calls else 0.0,
            "mean_seconds": seconds / calls if calls else 0.0,
        }

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=10)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_range(value: Any, spec: RewardSpec) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return math.isfinite(value) and spec.range[0] <= value <= spec.range[1]
