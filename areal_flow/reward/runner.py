"""Runs rewards so that a bad one can never stall training.

Every reward runs in a worker process (pebble, by ``forkserver``: never ``fork`` a process running
torch and threads), an async one under ``asyncio.run`` there, so blocking code cannot freeze the
caller's loop. A timeout kills and replaces the worker, a dead worker is replaced, and an error or
an out-of-range or non-finite score fails the call: it scores the reward's `default`, counted in
`stats()`. Invalid `metrics` fail the call too, but a valid score stands. A reward failing more
than `max_failure_rate` of its recent calls raises `RewardFailureError`: a run scored mostly by
defaults is not training on rewards. Workers import rewards by "module:function" with the
caller's `sys.path`, never the caller's main script (`_WorkerPopen`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import io
import logging
import math
import numbers
import os
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import forkserver, popen_forkserver, spawn, util
from multiprocessing.context import (ForkServerContext, ForkServerProcess, reduction,
                                    set_spawning_popen)
from typing import Any

from pebble import ProcessExpired, ProcessPool

import areal_flow
from areal_flow.process_memory import peak_rss_gb, rss_bytes
from areal_flow.registry import SPEC_ATTR, rewards
from areal_flow.types import RewardSpec, RunEndingError

log = logging.getLogger(__name__)


def resolve(reward: str | Callable[..., Any] | RewardSpec) -> RewardSpec:
    """A reward given by registered name, spec, or function (decorated or plain)."""
    if isinstance(reward, RewardSpec):
        return reward
    if isinstance(reward, str):
        return rewards.spec(reward)
    spec = getattr(reward, SPEC_ATTR, None)
    if isinstance(spec, RewardSpec) and spec.fn is reward:
        return spec
    return RewardSpec(name=getattr(reward, "__qualname__", repr(reward)), fn=reward)


def _importable_path(spec: RewardSpec, fn: Callable[..., Any]) -> str:
    """Where a worker process imports `fn`, the reward `spec` or its metrics, from."""
    module, qualname = fn.__module__, fn.__qualname__
    if module == "__main__" or "<" in qualname:  # <locals>, <lambda>
        what = "reward" if fn is spec.fn else "metrics function of reward"
        raise ValueError(f"{what} {spec.name!r} ({module}:{qualname}) cannot be imported by a "
                         "worker process; define it at the top level of a module")
    return f"{module}:{qualname}"


def _call_in_worker(path: str, package: str, args: tuple, kwargs: dict,
                    metrics: str | None = None) -> tuple[Any, Any, int]:
    """The reward `path`, then its `metrics` path (or None), under one timeout: (value,
    `task_metrics`' pair or None, this worker's resident bytes)."""
    if areal_flow.__file__ != package:  # e.g. a namespace package from a folder named areal_flow
        raise ImportError(f"the reward worker imported areal_flow from "
                          f"{list(areal_flow.__path__)}, the caller from {package}; check "
                          "sys.path and the working directory")
    value = rewards.get(path)(*args, **kwargs)
    # An async reward gets a loop of its own here, where the timeout can kill blocking code.
    value = asyncio.run(value) if inspect.iscoroutine(value) else value
    found = None if metrics is None else task_metrics(rewards.get(metrics), args, kwargs)
    try:  # the caller recycles a worker grown past its limit
        rss = rss_bytes()
    except (OSError, ValueError):  # no Linux /proc: the worker's peak
        rss = int(peak_rss_gb() * 2**30)
    return value, found, rss


class _WorkerPopen(popen_forkserver.Popen):
    """CPython 3.11's `popen_forkserver.Popen._launch`, except that the worker does not import
    the caller's `__main__` (a recipe's torch in each worker, an unguarded script run again)."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # the child watches this end to learn that its parent died
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _WorkerProcess(ForkServerProcess):
    _Popen = staticmethod(_WorkerPopen)


class _WorkerContext(ForkServerContext):
    # Nothing preloaded in the forkserver: it would import areal_flow with the forkserver's own
    # sys.path, whose first entry is the working directory, where a clone's root folder named
    # areal_flow shadows the package. Workers import it after taking the caller's sys.path.
    Process = _WorkerProcess


class RewardFailureError(RunEndingError):
    """A reward failed on too many of its recent calls to be trusted: the run ends."""


FAILURE_WINDOW = 64
"""A reward's failure rate is taken over its last this-many calls, once it has half as many."""


class RewardRunner:
    """Scores completions with registered rewards (module docstring; `max_failure_rate` 1 never
    raises). A worker is replaced after `max_calls_per_worker` calls, and the workers once one
    exceeds `max_worker_rss_gb` after a call (0: never), containing leaking rewards."""

    def __init__(self, max_workers: int = 2, max_failure_rate: float = 0.5,
                 max_calls_per_worker: int = 1000, max_worker_rss_gb: float = 2.0):
        if max_workers < 1:
            raise ValueError(f"'max_workers' must be >= 1: {max_workers}")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(f"'max_failure_rate' must be in [0, 1]: {max_failure_rate}")
        if max_calls_per_worker < 0 or max_worker_rss_gb < 0:
            raise ValueError(f"'max_calls_per_worker' and 'max_worker_rss_gb' must be >= 0 (0: "
                             f"no limit): {max_calls_per_worker}, {max_worker_rss_gb}")
        self.max_failure_rate = max_failure_rate
        self.max_worker_rss = max_worker_rss_gb * 2**30
        self._recent: dict[str, deque[bool]] = {}
        self._new_pool = functools.partial(ProcessPool, max_workers=max_workers,
                                           max_tasks=max_calls_per_worker, context=_WorkerContext())
        self._closed = False
        self._pool = self._new_pool()
        self._counts: Counter[str] = Counter()
        self._seconds = 0.0
        self._largest_rss = 0
        self._lock = threading.Lock()

    async def score(self, reward: str | Callable[..., Any] | RewardSpec, *args, **kwargs) -> float:
        """The reward's score, or its `default` if it raised, crashed, hung or went out of range."""
        return (await self._score(resolve(reward), args, kwargs, with_metrics=False))[0]

    async def score_with_metrics(self, reward: str | Callable[..., Any] | RewardSpec, *args,
                                 **kwargs) -> tuple[float, dict[str, float]]:
        """`score`, and the reward's `metrics` for the same arguments: {} when it has none or
        they are invalid, which fails the call (`metrics_errors`) though a valid score stands."""
        return await self._score(resolve(reward), args, kwargs, with_metrics=True)

    async def _score(self, spec: RewardSpec, args: tuple, kwargs: dict, *,
                     with_metrics: bool) -> tuple[float, dict[str, float]]:
        try:  # a signature mismatch is the caller's bug, not a bad completion: never a default
            inspect.signature(spec.fn).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"reward {spec.name!r} cannot take the arguments it is called with "
                            f"({exc}); accept them (e.g. **kwargs) or pick another reward: "
                            f"keywords {sorted(kwargs)}") from None
        path = _importable_path(spec, spec.fn)
        # the metrics run in the worker too, after the reward, under the same timeout
        metrics = _importable_path(spec, spec.metrics) \
            if with_metrics and spec.metrics is not None else None
        measured = None
        start = time.perf_counter()
        try:
            for tries_left in (1, 0):
                pool = self._workers()
                future = pool.schedule(_call_in_worker, timeout=spec.timeout,
                                       args=(path, areal_flow.__file__, args, kwargs, metrics))
                try:
                    value, measured, rss = await asyncio.wrap_future(future)
                    self._note_rss(rss, pool)
                    break
                except BrokenProcessPool:  # it broke before this call ran: once more on a new one
                    if not tries_left:
                        raise
            outcome, what = ("ok", "") if _in_range(value, spec) else \
                ("invalid", f"invalid: {value!r}")
        except TimeoutError:  # the worker was killed and is being replaced
            outcome, what = "timeouts", f"timed out after {spec.timeout} s"
        except ProcessExpired as exc:  # the worker died; pebble starts a new one
            outcome, what = "crashes", f"crashed ({_exit_status(exc.exitcode)})"
        except Exception as exc:
            outcome, what = "errors", f"error: {exc!r}"
        score = float(value) if outcome == "ok" else spec.default
        found: dict[str, float] = {}
        if measured is not None:
            # one outcome per call: counted once in the failure window, whichever part failed
            found, problem = measured
            if problem is not None and outcome == "ok":
                outcome, what = "metrics_errors", problem
        with self._lock:  # stats() is read from the trainer thread
            self._seconds += time.perf_counter() - start
            self._counts["calls"] += 1
            self._counts[outcome] += 1
            recent = self._recent.setdefault(spec.name, deque(maxlen=FAILURE_WINDOW))
            recent.append(outcome != "ok")
            failed, judged = sum(recent), len(recent)
        if outcome != "ok":
            if judged >= FAILURE_WINDOW // 2 and failed > self.max_failure_rate * judged:
                raise RewardFailureError(
                    f"reward {spec.name!r} failed on {failed} of its last {judged} calls, more "
                    f"than the limit of {self.max_failure_rate:.0%} (--reward-failure-limit); "
                    f"last failure: {what}. Fix the reward, or raise the limit (1 never stops)")
            log.warning("reward %r: %s; %s", spec.name, what, "no metrics recorded"
                        if outcome == "metrics_errors" else f"scored its default {spec.default}")
        return score, found

    def _note_rss(self, rss: int, pool: ProcessPool) -> None:
        """Note a worker's size; replace `pool`, if still current, when it is past the limit."""
        with self._lock:
            self._largest_rss = max(self._largest_rss, rss)
            if not self.max_worker_rss or rss <= self.max_worker_rss or self._closed \
                    or pool is not self._pool:
                return
            self._pool = self._new_pool()
            self._counts["recycled_pools"] += 1
        log.info("a reward worker holds %.2f GB, over the limit of %.2f GB: replacing the "
                 "workers", rss / 2**30, self.max_worker_rss / 2**30)
        pool.close()  # no new calls; join() runs what it holds, then stops its workers
        threading.Thread(target=pool.join, name="reward-pool-retire", daemon=True).start()

    def stats(self) -> dict[str, float]:
        """Calls, failures and the largest worker size (GB) since the last call."""
        with self._lock:
            counts, seconds, rss = self._counts, self._seconds, self._largest_rss
            self._counts, self._seconds, self._largest_rss = Counter(), 0.0, 0
        calls = counts["calls"]
        return {
            "calls": calls,
            **{key: counts[key] for key in ("timeouts", "crashes", "errors", "invalid",
                                            "metrics_errors", "pool_restarts", "recycled_pools")},
            "worker_rss_gb": rss / 2**30,
            "failure_rate": (calls - counts["ok"]) / calls if calls else 0.0,
            "mean_seconds": seconds / calls if calls else 0.0,
        }

    def _workers(self) -> ProcessPool:
        """The worker pool, replaced if broken: pebble 5 breaks it when a worker dies while idle
        (an OOM kill), then fails every later call."""
        with self._lock:
            if not self._pool.active and not self._closed:
                log.warning("the reward worker pool broke (a worker died while idle); starting "
                            "a new one")
                self._pool.stop()
                self._pool = self._new_pool()
                self._counts["pool_restarts"] += 1
            return self._pool

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.stop()
        self._pool.join(timeout=10)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def score_with_metrics(score: Callable[..., Any], reward: Any, *args,
                             **kwargs) -> tuple[float, dict[str, float]]:
    """What `RolloutContext.reward` records: the score from `score` (`RewardRunner.score`, or a
    tests' in-process stand-in, where failing metrics are only logged) and the checked metrics."""
    runner = getattr(score, "__self__", None)
    if isinstance(runner, RewardRunner):
        return await runner.score_with_metrics(reward, *args, **kwargs)
    value = await score(reward, *args, **kwargs)
    spec = resolve(reward)
    if spec.metrics is None:
        return value, {}
    found, problem = task_metrics(spec.metrics, args, kwargs)
    if problem is not None:
        log.warning("reward %r: %s; no metrics recorded", spec.name, problem)
    return value, found


def task_metrics(metrics: Callable[..., Any], args: tuple, kwargs: dict
                 ) -> tuple[dict[str, float], str | None]:
    """A reward's `metrics(*args, **kwargs)` as ({name: float}, None), or ({}, what was wrong)."""
    try:
        found = metrics(*args, **kwargs)
    except Exception as exc:
        return {}, f"metrics error: {exc!r}"
    problem = metrics_problem(found)
    return ({}, problem) if problem else ({k: float(v) for k, v in found.items()}, None)


def metrics_problem(found: Any) -> str | None:
    """Why `found` is not {plain name (no '/'): finite real number}, or None when it is."""
    allowed = ("a reward's metrics must return {name: finite number}, each name a plain word "
               "(no '/': an eval adds 'eval/')")
    if not isinstance(found, Mapping):
        return f"metrics invalid: returned {type(found).__name__} {found!r}; {allowed}"
    for name, value in found.items():
        if not isinstance(name, str) or not name or "/" in name:
            return f"metrics invalid: name {name!r}; {allowed}"
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            return f"metrics invalid: {name!r} is {type(value).__name__} {value!r}; {allowed}"
    return None


def _in_range(value: Any, spec: RewardSpec) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and spec.range[0] <= value <= spec.range[1])


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):  # not a signal's number
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
