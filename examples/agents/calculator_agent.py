"""An agent you already have: a plain `openai` tool-calling loop (a calculator tool, then a final
answer) that knows nothing about areal_flow. `train_calculator_agent.py` trains it unchanged.

    python calculator_agent.py BASE_URL API_KEY "What is 12 * 7?"   # against any endpoint
"""

from __future__ import annotations

import ast
import json
import operator
import sys

SYSTEM = ("Solve the problem. To compute, call the tool: <tool_call>{\"name\": \"calculate\", "
          "\"arguments\": {\"expression\": \"2 + 3\"}}</tool_call>. End with '#### <number>'.")
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate + - * / arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """+ - * / on numbers only (no eval), as text; an error message for anything else."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"{type(node).__name__} is not arithmetic")

    try:
        return str(value(ast.parse(str(expression), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"


async def solve(client, question: str, max_turns: int = 3) -> str:
    """A plain openai.AsyncOpenAI tool-calling loop; the final message's text."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        response = await client.chat.completions.create(model="policy", messages=messages,
                                                        tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(expression)})
    return ""


if __name__ == "__main__":  # the same agent in a process of its own, reached over HTTP
    import asyncio

    import openai

    base_url, key, question = sys.argv[1:4]
    print(asyncio.run(solve(openai.AsyncOpenAI(base_url=base_url, api_key=key), question)))
