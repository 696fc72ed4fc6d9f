"""Text environments, gymnasium-style: the `Environment` protocol, `@environment`, and the
gymnasium adapter. The `env` workflow (`areal_flow/agents/env.py`) plays them.

Registered in `registry.environments` (entry-point group ``areal_flow.environments``): a class
or factory the workflow calls as ``factory(**kwargs)`` once per episode. The dataset row reaches
the environment as ``reset(options=row)``, so one registered environment serves every row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from areal_flow.registry import environments

F = TypeVar("F", bound=Callable[..., Any])


@runtime_checkable
class Environment(Protocol):
    """Gymnasium's `reset`/`step` with text observations and actions. Either method may be
    ``async def`` (the workflow awaits what it returns); a synchronous one runs on the rollout
    event loop, so keep it quick or make it async. `close()`, if present, is called at the end."""

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode: the first observation (the user's first message) and an info dict.
        `options` is the dataset row; `seed` is derived from the episode's seed."""
        ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """The model's reply → (observation, reward, terminated, truncated, info)."""
        ...


def environment(name: str) -> Callable[[F], F]:
    """Register a class or factory (called as ``factory(**kwargs)``, returning an
    `Environment`) as environment `name`; it is returned unchanged."""
    return lambda factory: environments.register(name, factory)


class GymnasiumEnvironment:
    """A `gymnasium.Env` whose observation and action spaces are `gymnasium.spaces.Text`, as an
    `Environment`: rewards become floats, the dataset row goes to ``reset(options=...)``."""

    def __init__(self, env: Any):
        from gymnasium.spaces import Text

        for which in ("observation_space", "action_space"):
            space = getattr(env, which, None)
            if not isinstance(space, Text):
                env.close()
                raise TypeError(f"{env}: its {which} is {space!r}; the env workflow plays "
                                "environments whose observations and actions are "
                                "gymnasium.spaces.Text")
        self.env = env

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        observation, info = self.env.reset(seed=seed, options=options)
        return str(observation), dict(info)

    def step(self, action: str):
        observation, reward, terminated, truncated, info = self.env.step(action)
        return str(observation), float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self) -> None:
        self.env.close()


def gymnasium_env(id: str, **kwargs: Any) -> GymnasiumEnvironment:
    """Built-in environment ``gymnasium``: ``gymnasium.make(id, **kwargs)`` adapted. An id of
    the form ``"package.module:Name-v0"`` imports the module that registers it first."""
    import gymnasium

    return GymnasiumEnvironment(gymnasium.make(id, **kwargs))


__all__ = ["Environment", "GymnasiumEnvironment", "environment", "gymnasium_env"]
