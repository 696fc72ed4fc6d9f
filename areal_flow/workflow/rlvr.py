"""`rlvr`: one chat turn, scored by a verifiable reward (GSM8K by default)."""

from __future__ import annotations

import attrs

from areal_flow.workflow import workflow
from areal_flow.workflow.context import RolloutContext, field


@attrs.frozen(kw_only=True)
class RLVRConfig:
    """Options of the rlvr workflow."""

    reward: str = "gsm8k"
    """Registered reward called as reward(completion, answer=..., **reward_kwargs)."""
    reward_kwargs: dict[str, float] = attrs.field(factory=dict)
    """Extra keyword arguments of the reward, e.g. {format_weight: 0.2} for gsm8k."""
    question_field: str = "question"
    """Dataset field holding the question."""
    answer_field: str = "answer"
    """Dataset field holding the reference answer."""
    prompt_template: str = "{question}"
    """User message; {question} is replaced by the question."""
    system_prompt: str | None = None
    """Optional system message."""


@workflow("rlvr", config=RLVRConfig)
async def rlvr(ctx: RolloutContext, sample: dict):
    cfg = ctx.config or RLVRConfig()
    question = cfg.prompt_template.format(question=field(sample, cfg.question_field))
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    prompt = ctx.chat([*system, {"role": "user", "content": question}])
    out = await ctx.generate(prompt)
    score = await ctx.reward(cfg.reward, out.text, answer=field(sample, cfg.answer_field),
                             **cfg.reward_kwargs)
    return ctx.episode(prompt, out, reward=score)
