"""Rewards that misbehave on purpose, importable by reward worker processes."""

import hashlib
import os
import time

from areal_flow import reward


@reward("tests.length", timeout=5.0, range=(0.0, 100.0))
def length(completion: str) -> float:
    return float(len(completion))


@reward("tests.completion_length", timeout=5.0, range=(0.0, 1000.0))
def completion_length(completion: str, **fields) -> float:
    """Takes whatever a workflow passes (answer, options): a reward a critic can learn."""
    return float(len(completion))


@reward("tests.gated_length", timeout=120.0, range=(0.0, 1000.0))
def gated_length(completion: str, **fields) -> float:
    """`completion_length`, held while the file named by AREAL_TEST_GATE exists: a test holds a
    run's training at a point it chooses (a run advances only on rewarded groups)."""
    gate = os.environ.get("AREAL_TEST_GATE")
    while gate and os.path.exists(gate):
        time.sleep(0.05)
    return float(len(completion))


@reward("tests.sleeps_forever", timeout=0.5)
def sleeps_forever(completion: str) -> float:
    while True:
        time.sleep(60)


@reward("tests.kills_itself", timeout=5.0)
def kills_itself(completion: str) -> float:
    os.kill(os.getpid(), 9)
    return 1.0


@reward("tests.raises", timeout=5.0, default=0.25)
def raises(completion: str) -> float:
    raise RuntimeError("bad input")


@reward("tests.out_of_range", timeout=5.0)
def out_of_range(completion: str) -> float:
    return 7.0


@reward("tests.imports_torch", timeout=30.0, default=-1.0, range=(-1.0, 1.0))
def imports_torch(completion: str) -> float:
    """1 when the worker has torch loaded; -1 (the default) when the call failed, so that a
    broken pool never reads as "no torch"."""
    import sys
    return float("torch" in sys.modules)


@reward("tests.async_hangs", timeout=0.3, default=0.5)
async def async_hangs(completion: str) -> float:
    import asyncio
    await asyncio.Event().wait()
    return 1.0


@reward("tests.async_ok", timeout=1.0)
async def async_ok(completion: str) -> float:
    return 1.0 if completion else 0.0


@reward("tests.fails_on_x", timeout=5.0)
def fails_on_x(completion: str, **fields) -> float:
    """Fails on completions holding an 'x' and scores 1 otherwise: a reward failing as often as
    a test wants."""
    if "x" in completion:
        raise ValueError("an x")
    return 1.0


@reward("tests.always_fails", timeout=5.0)
def always_fails(completion: str, **fields) -> float:
    raise RuntimeError("this reward is broken")


@reward("tests.async_blocks", timeout=0.5, default=0.5)
async def async_blocks(completion: str) -> float:
    """Blocking code in an async reward: no await, so only killing its process can stop it."""
    time.sleep(20)
    return 1.0


@reward("tests.async_segfaults", timeout=5.0)
async def async_segfaults(completion: str) -> float:
    import ctypes
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return 1.0


@reward("tests.worker_pid", timeout=5.0, default=-1.0, range=(-1.0, 2.0**32))
def worker_pid(completion: str) -> float:
    """The process that scored: lets a test kill a worker while it is idle."""
    return float(os.getpid())


@reward("tests.text_hash", timeout=5.0)
def text_hash(completion: str, **fields) -> float:
    """A deterministic score no policy learns to saturate: every group keeps a spread, so every
    step moves the weights (long soak runs)."""
    return int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 1000 / 1000


def per_character(completion: str, **fields) -> dict[str, float]:
    """Metrics that fail on an empty completion (ZeroDivisionError), as a careless one would."""
    return {"per_character": 1 / len(completion)}


@reward("tests.metrics_divide", timeout=5.0, metrics=per_character)
def metrics_divide(completion: str, **fields) -> float:
    """A reward that never fails, with metrics that do on an empty completion."""
    return 1.0


@reward("tests.returns", timeout=5.0, default=0.5, range=(0.0, 1.0))
def returns(completion: str):
    """Returns what the completion names: "true" a bool, "text" the string "1", else the number
    it spells ("nan" included): what a careless reward might hand back."""
    return {"true": True, "text": "1"}.get(completion) or float(completion)


@reward("tests.naps", timeout=5.0)
def naps(completion: str) -> float:
    """Takes 50 ms: lets a test check the time the runner reports."""
    time.sleep(0.05)
    return 1.0


def correct(completion: str, answer: str) -> dict[str, float]:
    return {"correct": float(completion.strip() == answer)}


@reward("tests.matches", timeout=5.0, metrics=correct)
def matches(completion: str, answer: str) -> float:
    """Needs its keyword argument, as do its metrics."""
    return float(completion.strip() == answer)


_KEPT: list[bytes] = []


@reward("tests.leaks")
def leaks(completion: str) -> float:
    """Keeps 20 MB per call in a global (resident: filled, not calloc'd)."""
    _KEPT.append(b"x" * (20 * 2**20))
    return 1.0


@reward("tests.leaking_text_hash", timeout=5.0)
def leaking_text_hash(completion: str, **fields) -> float:
    """`text_hash`, keeping 10 MB per call in a global: a leak the runner must contain
    (benchmarks/soak.py)."""
    _KEPT.append(b"x" * (10 * 2**20))
    return text_hash(completion)


def returns_found(completion: str, found=None):
    """Metrics that return what the call's `found` says: each wrong shape a careless one might."""
    return found


@reward("tests.length_with_found", timeout=5.0, range=(0.0, 100.0), metrics=returns_found)
def length_with_found(completion: str, found=None) -> float:
    return float(len(completion))


def metrics_sleep_forever(completion: str) -> dict[str, float]:
    time.sleep(3600)
    return {}


@reward("tests.metrics_hang", timeout=0.5, default=0.25, metrics=metrics_sleep_forever)
def metrics_hang(completion: str) -> float:
    """A reward that answers at once, with metrics that never return."""
    return 1.0
