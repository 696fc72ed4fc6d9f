"""`@algorithm`: classes of loss steps on tensors (`areal_flow.types.Algorithm`); torch-free."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from areal_flow.registry import algorithms
from areal_flow.types import AlgorithmSpec

C = TypeVar("C", bound=type)


def algorithm(name: str, *, config: type | None = None) -> Callable[[C], C]:
    """Register a class implementing `areal_flow.types.Algorithm` as `name`, built with a
    `config` instance; returns the class unchanged."""
    def decorate(cls: C) -> C:
        if not isinstance(cls, type):
            raise TypeError(f"algorithm {name!r} must decorate a class, not {cls!r}")
        return algorithms.register(name, AlgorithmSpec(name=name, cls=cls, config=config))

    return decorate


__all__ = ["AlgorithmSpec", "algorithm"]
