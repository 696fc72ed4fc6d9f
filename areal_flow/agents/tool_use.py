"""`tool_use`: the model may write <calc>expression</calc>; a sandboxed calculator answers with
<result>value</result> as environment tokens (not trained on), and the model continues."""

from __future__ import annotations

import ast
import operator
import re

import attrs
from attrs import validators as v

from areal_flow.workflow import workflow
from areal_flow.workflow.context import RolloutContext, field

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
SYSTEM = ("You can use a calculator: write <calc>expression</calc> and its value follows as "
          "<result>value</result>. End with '#### <answer>'.")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate arithmetic on numbers only (no names, calls or attributes: nothing to escape to)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
        return f"{result:g}" if isinstance(result, float) else str(result)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError) as exc:
        return f"error: {type(exc).__name__}"


@attrs.frozen(kw_only=True)
class ToolUseConfig:
    """Options of the tool_use workflow."""

    reward: str = "gsm8k"
    """Registered reward called as reward(final text, answer=...)."""
    question_field: str = "question"
    """Dataset field holding the question."""
    answer_field: str = "answer"
    """Dataset field holding the reference answer."""
    max_calls: int = attrs.field(default=3, validator=v.ge(0))
    """Most calculator calls per episode."""


@workflow("tool_use", config=ToolUseConfig)
async def tool_use(ctx: RolloutContext, sample: dict):
    cfg = ctx.config or ToolUseConfig()
    prompt = ctx.chat([{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": field(sample, cfg.question_field)}])
    episode, context, text = ctx.episode(prompt), list(prompt), ""
    for _ in range(cfg.max_calls + 1):
        out = ctx.stop_at(await ctx.generate(context), "</calc>")
        episode.add(out)
        context += out.token_ids
        text += out.text or ""
        call = CALL.search(out.text or "")
        if call is None or out.finish_reason != "stop":
            break
        result = ctx.encode(f"<result>{calculate(call.group(1))}</result>\n")
        episode.add_tokens(result)
        context += result
    episode.reward = await ctx.reward(cfg.reward, text, answer=field(sample, cfg.answer_field))
    return episode
