"""Workflows that misbehave on purpose, named by path (`tests.workflows_for_tests:...`) in
recipe tests."""

import asyncio

import attrs

from areal_flow import workflow
from areal_flow.workflow.rlvr import RLVRConfig, rlvr

_calls = 0


@workflow("tests.hangs_after_8_episodes", config=RLVRConfig)
async def hangs_after_8_episodes(ctx, sample):
    """rlvr for the first 8 episodes (two steps of 2 prompts x 2), then never returns: a
    rollout that can no longer produce a batch (every server gone, every workflow stuck)."""
    global _calls
    _calls += 1
    if _calls > 8:
        await asyncio.Event().wait()
    return await rlvr(ctx, sample)


@attrs.frozen
class NoRewardConfig:
    prefix: str = "Q: "


@workflow("tests.no_reward_option", config=NoRewardConfig)
async def no_reward_option(ctx, sample):
    """A workflow whose config has no `reward` field: --reward cannot apply to it."""
    return None


@attrs.frozen
class JudgedConfig:
    rubric: str = "Full marks for a correct answer with its working shown."
    judge_max_new_tokens: int = 8


@workflow("tests.judged", config=JudgedConfig)
async def judged(ctx, sample):
    """One turn, rewarded by an LLM judge (the policy itself, through ctx.judge)."""
    cfg = ctx.config or JudgedConfig()
    prompt = ctx.chat([{"role": "user", "content": sample["question"]}])
    out = await ctx.generate(prompt)
    score = await ctx.judge(cfg.rubric, out.text, question=sample["question"],
                            max_new_tokens=cfg.judge_max_new_tokens)
    return ctx.episode(prompt, out, reward=score)
