"""`@workflow`: async functions that turn one dataset sample into one episode."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

from areal_flow.registry import workflows
from areal_flow.types import WorkflowSpec

F = TypeVar("F", bound=Callable[..., object])


def workflow(name: str, *, config: type | None = None) -> Callable[[F], F]:
    """Register ``async fn(ctx, sample) -> Episode | None`` as workflow `name`; `config` is an
    attrs class of its options."""
    def decorate(fn: F) -> F:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"workflow {name!r} must be an 'async def' function")
        return workflows.register(name, WorkflowSpec(name=name, fn=fn, config=config))

    return decorate


__all__ = ["WorkflowSpec", "workflow"]
