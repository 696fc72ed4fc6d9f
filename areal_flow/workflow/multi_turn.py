"""`multi_turn`: answer, hear "not correct", try again — until right or out of turns.

The episode holds every model turn (trained on) and the feedback between them (not trained
on); its reward is the final turn's score discounted by `discount` per extra turn.
"""

from __future__ import annotations

import attrs
from attrs import validators as v

from areal_flow.workflow import workflow
from areal_flow.workflow.context import RolloutContext, field


@attrs.frozen(kw_only=True)
class MultiTurnConfig:
    """Options of the multi_turn workflow."""

    reward: str = "gsm8k"
    """Registered reward called as reward(completion, answer=..., **reward_kwargs)."""
    reward_kwargs: dict[str, float] = attrs.field(factory=dict)
    """Extra keyword arguments of the reward."""
    question_field: str = "question"
    """Dataset field holding the question."""
    answer_field: str = "answer"
    """Dataset field holding the reference answer."""
    max_turns: int = attrs.field(default=3, validator=v.ge(1))
    """Most answers the model may give."""
    discount: float = attrs.field(default=0.9, validator=[v.gt(0.0), v.le(1.0)])
    """Reward factor per turn after the first, in (0, 1]."""
    success: float = 1.0
    """A score at least this high ends the episode."""
    feedback: str = "That is not correct. Please try again."
    """User message after a wrong answer."""


@workflow("multi_turn", config=MultiTurnConfig)
async def multi_turn(ctx: RolloutContext, sample: dict):
    cfg = ctx.config or MultiTurnConfig()
    answer = field(sample, cfg.answer_field)
    messages = [{"role": "user", "content": field(sample, cfg.question_field)}]
    prompt = ctx.chat(messages)
    episode, context = ctx.episode(prompt), list(prompt)
    for turn in range(cfg.max_turns):
        out = await ctx.generate(context)
        episode.add(out)
        context += out.token_ids
        score = await ctx.reward(cfg.reward, out.text, answer=answer, **cfg.reward_kwargs)
        # a cut-off answer has no end-of-turn token to continue the chat after
        if score >= cfg.success or out.finish_reason != "stop" or turn == cfg.max_turns - 1:
            break
        messages.append({"role": "assistant", "content": out.text})
        retry = {"role": "user", "content": cfg.feedback}
        feedback = ctx.chat_delta(messages, [retry], completion=out)
        messages.append(retry)
        episode.add_tokens(feedback)
        context += feedback
    episode.reward = score * cfg.discount**turn
    episode.metrics["turns"] = turn + 1  # on the panel: how many tries the model needed
    return episode
