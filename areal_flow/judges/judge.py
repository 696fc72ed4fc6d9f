"""LLM-as-judge: a model grades a completion against a rubric, in the rollout process.

`Judge(...)(ctx, rubric, completion)` (or `await ctx.judge(rubric, completion)`) renders a judge
prompt (the rubric, optionally the question, the completion, and an instruction to end with a
line ``Score: N``), generates with the policy's pool or with a judge pool of its own, parses the
last ``Score: N`` and maps it from `scale` to [0, 1]. A reply with no score, a score outside
`scale`, or no reply within `timeout` seconds scores `default`. Each call's outcome is counted in
`ctx.metrics` as the fraction of the episode's judge calls that had it (`judge_parsed`,
`judge_out_of_range`, `judge_timeout`; the rest had no ``Score:`` line), so the panel shows how
often the judge failed.

The judge's tokens are never part of the episode: only what the workflow adds to it is trained
on, and the judge's request goes straight to the pool, so it does not advance the episode's
sampling-seed counter either (a workflow samples the same with or without a judge). Errors of
the pool other than the timeout (a server gone) propagate, as `ctx.generate`'s do.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from typing import Any

import anyio
import attrs

from areal_flow.types import GenerationPool, GenerationRequest, derived_seed
from areal_flow.workflow.context import template_ids

log = logging.getLogger(__name__)

PROMPT = """You are grading a response against a rubric.

Rubric:
{rubric}
{question_block}
Response:
{completion}

Judge the response by the rubric. Be brief, then end your reply with a line of the form \
"Score: N", where N is a number from {low} to {high}."""
"""The default judge prompt: `str.format` fields `rubric`, `question_block` (empty, or
"\\nQuestion:\\n<question>\\n"), `completion`, `low`, `high`. Braces inside the rubric or the
completion are safe: only the template is a format string."""

SCORE = re.compile(
    r"\bscore\**[ \t]*[:=][ \t]*\**[ \t]*([-+]?(?:\d+(?:\.\d*)?|\.\d+))(?!\w)", re.IGNORECASE)
"""``Score: N`` (any case, markdown bold allowed: ``**Score:** 7``), N a plain decimal number;
the number may be followed by punctuation (``7.``, ``7/10``) but not by a letter (``1e5``)."""

OUTCOMES = ("parsed", "no_score", "out_of_range", "timeout")
METRICS = ("parsed", "out_of_range", "timeout")
"""Outcomes reported in `ctx.metrics` as ``judge_<outcome>`` (``no_score`` is the rest)."""


@attrs.frozen
class Verdict:
    """One judge call: the score in [0, 1] (or the default), its outcome (one of `OUTCOMES`),
    the number the judge wrote (None when none was found) and the judge's reply text."""

    score: float
    outcome: str
    raw: float | None = None
    text: str = ""


def parse_score(text: str, scale: tuple[float, float] = (0, 10)) -> tuple[str, float | None]:
    """(outcome, number) for the last ``Score: N`` in `text`: ("parsed", N) when N lies within
    `scale`, ("out_of_range", N) when not, ("no_score", None) when no such line is found."""
    found = SCORE.findall(text)
    if not found:
        return "no_score", None
    value = float(found[-1])
    low, high = scale
    if not (math.isfinite(value) and low <= value <= high):
        return "out_of_range", value
    return "parsed", value


@attrs.frozen(kw_only=True)
class Judge:
    """Grades completions with a model; call it with the episode's `RolloutContext`.

    Args:
        pool: the judge model's `GenerationPool`; None uses the policy's (`ctx.pool`).
        tokenizer: the judge model's tokenizer (its chat template renders the prompt); None uses
            `ctx.tokenizer`, right for the policy's pool or a judge of the same family.
        scale: the lowest and highest score the judge may write; mapped to 0 and 1.
        timeout: seconds a call may take before it scores `default`.
        default: the score of a call that timed out or whose reply has no valid score.
        template: the prompt (see `PROMPT` for its fields).
        sampling: overrides of the run's sampling settings for the judge's request; greedy
            (``temperature=0.0``) unless given.
    """

    pool: GenerationPool | None = None
    tokenizer: Any = None
    scale: tuple[float, float] = attrs.field(default=(0, 10), converter=tuple)
    timeout: float = 30.0
    default: float = 0.0
    template: str = PROMPT
    sampling: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        low, high = self.scale
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"'scale' must be two finite numbers, low < high: {self.scale}")
        if not self.timeout > 0:
            raise ValueError(f"'timeout' must be > 0: {self.timeout}")

    def prompt(self, rubric: str, completion: str, question: str | None = None) -> str:
        """The judge's user message."""
        block = "" if question is None else f"\nQuestion:\n{question}\n"
        low, high = (_number(x) for x in self.scale)
        return self.template.format(rubric=rubric, question_block=block, completion=completion,
                                    low=low, high=high)

    async def __call__(self, ctx: Any, rubric: str, completion: str, *,
                       question: str | None = None) -> float:
        """The score in [0, 1], or `default`; the outcome is counted in `ctx.metrics`."""
        return (await self.grade(ctx, rubric, completion, question=question)).score

    async def grade(self, ctx: Any, rubric: str, completion: str, *,
                    question: str | None = None) -> Verdict:
        """`__call__` with the details: the outcome, the number written, the reply."""
        pool = self.pool if self.pool is not None else ctx.pool
        tokenizer = self.tokenizer if self.tokenizer is not None else ctx.tokenizer
        ids = _chat_ids(tokenizer, self.prompt(rubric, completion, question))
        params = attrs.evolve(ctx.sampling, **{"temperature": 0.0, **self.sampling})
        calls = _tally(ctx)
        if params.seed is None and not params.greedy and ctx.seed is not None:
            params = attrs.evolve(params, seed=derived_seed(ctx.seed, "judge", calls.total()))
        request = GenerationRequest(input_ids=ids, sampling=params)  # no episode_id: no prefix
        try:
            with anyio.fail_after(self.timeout):
                out = await pool.generate(request)
        except TimeoutError:
            verdict = Verdict(self.default, "timeout")
        else:
            text = out.text if out.text is not None else tokenizer.decode(
                out.token_ids, skip_special_tokens=True)
            outcome, raw = parse_score(text, self.scale)
            low, high = self.scale
            score = (raw - low) / (high - low) if outcome == "parsed" else self.default
            verdict = Verdict(score, outcome, raw, text)
        if verdict.outcome != "parsed":
            log.debug("judge scored the default (%s): %r", verdict.outcome, verdict.text[-200:])
        calls[verdict.outcome] += 1
        n = calls.total()
        ctx.metrics.update({f"judge_{name}": calls[name] / n for name in METRICS})
        return verdict


def _tally(ctx: Any) -> Counter:
    """The episode's judge outcomes so far (kept on the context, one per episode)."""
    calls = getattr(ctx, "_judge_calls", None)
    if calls is None:
        calls = Counter()
        ctx._judge_calls = calls
    return calls


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat_template", None):
        ids = template_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    else:  # a base model: the prompt as plain text
        ids = tokenizer.encode(text)
    return [int(t) for t in ids]


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


__all__ = ["Judge", "OUTCOMES", "PROMPT", "Verdict", "parse_score"]
