"""`@reward`: pure functions that score a completion."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from areal_flow.registry import rewards
from areal_flow.types import RewardSpec

F = TypeVar("F", bound=Callable[..., object])


def reward(name: str, *, timeout: float = 10.0, default: float = 0.0,
           range: tuple[float, float] = (0.0, 1.0),  # noqa: A002 - the contract's own word
           metrics: Callable[..., dict[str, float]] | None = None,
           rates: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Register ``fn(completion: str, **kwargs) -> float`` (sync or async) as reward `name`.

    It runs in a worker process, so it must be defined at the top level of a module. A call that
    raises, crashes or runs past `timeout` seconds scores `default`; scores must lie in `range`.
    `metrics(same arguments)` returns the task's numbers for the panel and metrics.jsonl; `rates`
    names those that are 0 or 1 per episode (eval gives them a 95% interval)."""
    def decorate(fn: F) -> F:
        spec = RewardSpec(name=name, fn=fn, timeout=timeout, default=default, range=range,
                          metrics=metrics, rates=rates)
        return rewards.register(name, spec)

    return decorate


__all__ = ["RewardSpec", "reward"]
