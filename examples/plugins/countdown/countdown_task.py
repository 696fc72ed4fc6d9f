"""Countdown as an areal_flow plugin, in one file: reach a target number with arithmetic.

A problem gives numbers (e.g. [3, 7, 25, 50]) and a target (e.g. 75); the model answers with an
expression in <answer>...</answer> tags (``<answer>50 + 25</answer>``) that uses + - * /,
unary minus and parentheses, and each given number AT MOST ONCE (as in the TV game: a number may
be left out, and a number given twice may be used twice). Division is exact (7 / 2 is 7/2).

- reward ``countdown``: 1 for a correct answer, 0.1 for an expression that uses only the given
  numbers but has another value, 0 for anything else (no tags, not arithmetic, a number that was
  not given or used too often, a division by zero);
- workflows ``countdown.single_turn`` and ``countdown.two_turn`` (a wrong first answer gets the
  environment's feedback, e.g. "Your expression evaluates to 70, not 75.", and a second try);
- algorithm ``countdown.loo``: a leave-one-out (RLOO) policy gradient;
- data: ``make_rows(n, seed)``, or ``python -m countdown_task countdown.jsonl``.

Reward workers import this module: torch is imported only inside the algorithm's methods
(`areal_flow.algorithms.functional`), so they stay light.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections import Counter
from fractions import Fraction
from typing import NamedTuple

import attrs
from attrs import validators as v

from areal_flow import LossOutput, algorithm, reward, workflow
from areal_flow.config import PolicyLossConfig
from areal_flow.workflow.context import field

# ----------------------------------------------------------------------------------- reward

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ALLOWED = set("0123456789+-*/() \t\n")
MAX_LENGTH = 200  # also keeps ast.parse far from its nesting limits
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
NODES = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
FORMAT_SCORE = 0.1


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`. Raises ValueError unless it is built from non-negative
    integers, + - * /, unary minus and parentheses only; ZeroDivisionError if it divides by 0."""
    if len(expression) > MAX_LENGTH or not set(expression) <= ALLOWED:
        raise ValueError("not an arithmetic expression of the allowed characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in NODES:  # checked before recursing
            return OPS[NODES[type(node.op)]](value(node.left), value(node.right))
        raise ValueError(f"{type(node).__name__} is not allowed")

    return value(tree)


class Verdict(NamedTuple):
    """What `judge` found in a completion."""

    expression: str | None  # the last <answer>...</answer>, stripped; None without one
    well_formed: bool  # it is an expression `evaluate` accepts (a division by zero included)
    numbers_valid: bool  # it uses each number at most as often as `numbers` holds it
    value: Fraction | None  # its value; None when not well formed or dividing by zero
    solved: bool


def judge(completion: str, numbers: list[int], target: int) -> Verdict:
    """Everything the reward, its metrics and the two-turn feedback say about a completion."""
    found = ANSWER.findall(completion)
    if not found:
        return Verdict(None, False, False, None, False)
    expression = found[-1].strip()
    try:
        value = evaluate(expression)
    except ValueError:
        return Verdict(expression, False, False, None, False)
    except ZeroDivisionError:
        value = None
    # only digits, operators and parentheses parsed: the digit runs are the numbers used
    used = Counter(int(d) for d in re.findall(r"\d+", expression))
    valid = not used - Counter(numbers)
    return Verdict(expression, True, valid, value,
                   valid and value is not None and value == Fraction(target))


def countdown_metrics(completion: str, *, numbers: list[int], target: int) -> dict[str, float]:
    """What the training panel shows besides the reward: solved, format, numbers_valid."""
    verdict = judge(completion, numbers, target)
    return {"solved": float(verdict.solved), "format": float(verdict.well_formed),
            "numbers_valid": float(verdict.numbers_valid)}


@reward("countdown", timeout=2.0, default=0.0, range=(0.0, 1.0), metrics=countdown_metrics,
        rates=("solved", "format", "numbers_valid"))
def countdown(completion: str, *, numbers: list[int], target: int) -> float:
    """1 if the last <answer> reaches `target` using each of `numbers` at most once; 0.1 if it
    uses only those numbers but has another value; else 0."""
    verdict = judge(completion, numbers, target)
    if verdict.solved:
        return 1.0
    return FORMAT_SCORE if verdict.numbers_valid and verdict.value is not None else 0.0


# ----------------------------------------------------------------------------------- data

INSTRUCTIONS = (
    "Using the numbers {numbers}, write an arithmetic expression that equals {target}. You may "
    "use +, -, *, / and parentheses, and each number at most once. Think briefly, then give "
    "only the expression inside <answer></answer> tags, for example <answer>(1 + 2) * 3</answer>."
)


def make_rows(n: int, seed: int = 0, *, count: int = 4, max_number: int = 99,
              max_target: int = 100) -> list[dict]:
    """`n` solvable problems: `count` numbers in 1..max_number, and as target the value of a
    random expression over some of them (kept when a whole number in 1..max_target). Rows have
    `numbers`, `target`, `question` (the prompt) and `solution` (that expression)."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        terms = [(str(x), Fraction(x)) for x in rng.sample(numbers, rng.randint(2, count))]
        while len(terms) > 1:  # combine two random terms until one is left
            a, x = terms.pop(rng.randrange(len(terms)))
            b, y = terms.pop(rng.randrange(len(terms)))
            op = rng.choice("+-*/" if y else "+-*")
            terms.append((f"({a} {op} {b})", OPS[op](x, y)))
        solution, value = terms[0][0][1:-1], terms[0][1]
        if value.denominator == 1 and 1 <= value <= max_target:
            target = int(value)
            rows.append({"numbers": numbers, "target": target, "solution": solution,
                         "question": INSTRUCTIONS.format(numbers=numbers, target=target)})
    return rows


# ----------------------------------------------------------------------------------- workflows


@attrs.frozen(kw_only=True)
class CountdownConfig:
    """Options of the countdown workflows (--workflow-config; --reward sets `reward`)."""

    reward: str = "countdown"
    """A registered reward, called as reward(completion, numbers=..., target=...)."""
    discount: float = attrs.field(default=0.9, validator=[v.gt(0.0), v.le(1.0)])
    """two_turn: the second attempt's score is multiplied by this."""


def feedback(verdict: Verdict, numbers: list[int], target: int) -> str:
    """The environment's reply to a wrong answer."""
    if verdict.expression is None:
        problem = "I found no <answer></answer> tags in your reply."
    elif not verdict.well_formed:
        problem = "Your answer is not an expression of numbers, + - * / and parentheses."
    elif not verdict.numbers_valid:
        problem = f"Your expression uses numbers you do not have: use each of {numbers} at " \
            "most once."
    elif verdict.value is None:
        problem = "Your expression divides by zero."
    else:
        problem = f"Your expression evaluates to {verdict.value}, not {target}."
    return problem + " Try again."


@workflow("countdown.single_turn", config=CountdownConfig)
async def single_turn(ctx, sample: dict):
    cfg = ctx.config or CountdownConfig()
    prompt = ctx.chat([{"role": "user", "content": field(sample, "question")}])
    out = await ctx.generate(prompt)
    score = await ctx.reward(cfg.reward, out.text, numbers=field(sample, "numbers"),
                             target=field(sample, "target"))
    return ctx.episode(prompt, out, reward=score)


@workflow("countdown.two_turn", config=CountdownConfig)
async def two_turn(ctx, sample: dict):
    cfg = ctx.config or CountdownConfig()
    numbers, target = field(sample, "numbers"), field(sample, "target")
    messages = [{"role": "user", "content": field(sample, "question")}]
    prompt = ctx.chat(messages)
    episode, context = ctx.episode(prompt), list(prompt)
    for turn in range(2):
        out = await ctx.generate(context)
        episode.add(out)  # the model's tokens: trained on
        context += out.token_ids
        score = await ctx.reward(cfg.reward, out.text, numbers=numbers, target=target)
        # a turn cut off at its token budget has no end-of-turn token to continue the chat after
        if score >= 1.0 or out.finish_reason != "stop" or turn == 1:
            break
        messages.append({"role": "assistant", "content": out.text})
        retry = {"role": "user", "content": feedback(judge(out.text, numbers, target),
                                                     numbers, target)}
        tokens = ctx.chat_delta(messages, [retry], completion=out)  # what the template adds
        messages.append(retry)
        episode.add_tokens(tokens)  # the environment's tokens: context, never trained on
        context += tokens
    episode.reward = score * cfg.discount**turn
    episode.info["turns"] = episode.metrics["turns"] = turn + 1  # metrics: on the panel too
    return episode


# ----------------------------------------------------------------------------------- algorithm


@attrs.frozen(kw_only=True)
class LOOConfig:
    """Options of countdown.loo (--algorithm.clip-eps, ...)."""

    clip_eps: float = attrs.field(default=0.2, validator=v.gt(0.0))
    """PPO clip range of the ratio pi_theta / pi_prox."""
    std_normalize: bool = False
    """Also divide the advantages by the group's reward std."""
    weight_cap: float | None = attrs.field(default=5.0, validator=v.optional(v.gt(1.0)))
    """Cap of the off-policy weight pi_prox / pi_behav (None: uncapped)."""
    recompute_proximal: bool = False
    """Take pi_prox from a forward pass before the update (the actor role); else interpolate it
    from the versions (F.interpolate_proximal), with no extra forward."""


@algorithm("countdown.loo", config=LOOConfig)
class LOO:
    """RLOO: A_i = r_i - mean of the OTHER rows of its group (0 for a group of one or with equal
    rewards), the same for every model token of row i. Loss per model token, averaged over the
    batch's model tokens (pi_behav sampled the token, pi_prox is the policy before this update):
        w * max(-rho A, -clip(rho, 1 - eps, 1 + eps) A),  rho = pi_theta / pi_prox,
        w = min(pi_prox / pi_behav, cap) (no gradient)
    On-policy (pi_theta = pi_prox = pi_behav) its gradient is -A/N grad log pi_theta per token."""

    skips_zero_advantage_rows = True  # no term but the advantage-weighted one
    min_group_size = 2  # a row alone in its group has no other rows to compare with

    def __init__(self, config: LOOConfig | None = None):
        self.config = config or LOOConfig()
        self.roles = ("actor",) if self.config.recompute_proximal else ()

    def advantages(self, batch):
        from areal_flow.algorithms import functional as F

        adv = F.group_advantages(batch["rewards"].float(), batch["group_ids"], leave_one_out=True,
                                 std_normalize=self.config.std_normalize)
        batch["advantages"] = adv[:, None] * batch["loss_mask"]
        return batch

    def loss(self, out, mb):
        from areal_flow.algorithms import functional as F

        per_token, stats = F.decoupled_policy_loss(out.logprobs, mb, PolicyLossConfig(
            eps_clip=self.config.clip_eps, importance_weight_cap=self.config.weight_cap,
            recompute_proximal=self.config.recompute_proximal))
        loss_sum, normalizer, unit = F.token_level(per_token, mb.loss_mask)
        return LossOutput(loss_sum=loss_sum, normalizer=normalizer, unit=unit, stats=stats)


if __name__ == "__main__":  # python -m countdown_task countdown.jsonl [--rows N] [--seed S]
    import argparse

    parser = argparse.ArgumentParser(description="Write Countdown problems as JSON lines.")
    parser.add_argument("path")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in make_rows(args.rows, args.seed))
    print(f"wrote {args.rows} Countdown problems to {args.path}")
