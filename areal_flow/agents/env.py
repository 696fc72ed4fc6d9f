"""`env`: the model plays a registered text `Environment` (`areal_flow/agents/environment.py`), one
reply per step, until the environment ends the episode or `max_turns` replies were made.

The episode holds the first observation as the prompt, every reply (trained on) and every later
observation as a user turn (not trained on). Its reward is the discounted sum of step rewards.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import attrs
from attrs import validators as v

from areal_flow.registry import environments
from areal_flow.types import derived_seed
from areal_flow.workflow import workflow
from areal_flow.workflow.context import RolloutContext


def _registered(_config: Any, _attribute: Any, name: str) -> None:
    environments.get(name)  # an unknown name fails now, before any model loads, with the known


@attrs.frozen(kw_only=True)
class EnvConfig:
    """Options of the env workflow."""

    environment: str = attrs.field(validator=_registered)
    """Registered environment (or a 'package.module:attribute' path), e.g. `gymnasium`."""
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    """Keyword arguments of its factory, called once per episode: for `gymnasium`, the id and
    the arguments of gymnasium.make, e.g. {id: "my_pkg.envs:Guess-v0", max_number: 20}."""
    max_turns: int = attrs.field(default=8, validator=v.ge(1))
    """Most replies (steps) per episode; reaching it without `terminated` marks it truncated."""
    system_prompt: str | None = None
    """Optional system message before the first observation."""
    discount: float = attrs.field(default=1.0, validator=[v.gt(0.0), v.le(1.0)])
    """Reward = sum over steps t = 0, 1, ... of discount**t * reward_t."""


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


@workflow("env", config=EnvConfig)
async def env(ctx: RolloutContext, sample: dict):
    cfg = ctx.config
    if cfg is None:
        raise ValueError('the env workflow needs a config naming its environment: '
                         '--workflow-config \'{"environment": "NAME"}\'')
    game = environments.get(cfg.environment)(**cfg.kwargs)
    try:
        seed = None if ctx.seed is None else derived_seed(ctx.seed, "env")
        observation, info = await _value(game.reset(seed=seed, options=dict(sample)))
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        messages = [*system, {"role": "user", "content": observation}]
        prompt = ctx.chat(messages)
        episode, context = ctx.episode(prompt), list(prompt)
        total = discounted = 0.0
        for turn in range(cfg.max_turns):
            out = await ctx.generate(context)
            episode.add(out)  # trained on
            context += out.token_ids
            text = out.text if out.text is not None else \
                ctx.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            # a reply cut at its token budget is still the action; the episode ends after it
            observation, reward, terminated, truncated, info = await _value(game.step(text))
            total += float(reward)
            discounted += cfg.discount**turn * float(reward)
            if terminated or truncated or out.finish_reason != "stop" or turn + 1 == cfg.max_turns:
                break
            messages.append({"role": "assistant", "content": text})
            user = {"role": "user", "content": observation}
            said = ctx.chat_delta(messages, [user], completion=out)  # context only
            messages.append(user)
            episode.add_tokens(said)
            context += said
    finally:
        if callable(close := getattr(game, "close", None)):
            await _value(close())
    episode.reward = discounted
    episode.truncated = not terminated  # cut: by the env, the token budget or max_turns
    reported = info.get("metrics")
    if isinstance(reported, dict):
        episode.metrics.update({k: float(x) for k, x in reported.items()
                                if isinstance(x, numbers.Real)})
    episode.metrics.update(turns=turn + 1, terminated=float(terminated), env_return=total)
    episode.info.update(environment=cfg.environment, observation=observation, env_info=info)
    return episode
