"""The GSM8K reward: the final number of a completion compared exactly with the reference.

The final answer is the first number after the last ``####``, else the first inside the last
``\\boxed{...}``, else the last number anywhere. Thousands separators, ``$``, a trailing ``%``
and trailing decimal zeros are ignored (``$1,234.00`` equals ``1234``); only ASCII digits count."""

from __future__ import annotations

import re
from decimal import Decimal

from areal_flow.reward import reward

_NUMBER = re.compile(r"(-)?\s?\$?\s?((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)\s?%?",
                     re.ASCII)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_CALCULATION = re.compile(r"\d\s*[-+*/×÷x]\s*\$?\d[\d,.]*\s*%?\s*=\s*\$?\s*-?\d", re.ASCII)
"""One worked step: a number, an operator, a number, '=' and a number (``8 * 9 = 72``)."""


def _to_decimal(match: re.Match[str]) -> Decimal:
    # `_NUMBER` matches only ASCII digits with an optional point: always a finite Decimal
    return Decimal((match.group(1) or "") + match.group(2).replace(",", ""))


def _first_number(text: str) -> Decimal | None:
    match = _NUMBER.search(text)
    return _to_decimal(match) if match else None


def extract_answer(text: str) -> Decimal | None:
    """The final numeric answer of `text` by the rules in the module docstring, or None."""
    if "####" in text and (found := _first_number(text.rsplit("####", 1)[1])) is not None:
        return found
    boxed = _BOXED.findall(text)
    if boxed and (found := _first_number(boxed[-1])) is not None:
        return found
    numbers = list(_NUMBER.finditer(text))
    return _to_decimal(numbers[-1]) if numbers else None


def grade(completion: str, answer: str, **_: object) -> dict[str, float]:
    """The reward's `metrics`: "accuracy" (the final number is right), "accuracy_lenient" (it
    appears anywhere), "format" (``#### N`` used) and "work_shown" (`shows_work`)."""
    expected = extract_answer(str(answer))
    anywhere = {_to_decimal(m) for m in _NUMBER.finditer(completion)}
    return {"accuracy": float(expected is not None and extract_answer(completion) == expected),
            "accuracy_lenient": float(expected is not None and expected in anywhere),
            "format": float(has_answer_format(completion)),
            "work_shown": float(shows_work(completion))}


def has_answer_format(text: str) -> bool:
    """True when the completion states its answer as ``#### N``."""
    return "####" in text and _first_number(text.rsplit("####", 1)[1]) is not None


def shows_work(text: str) -> bool:
    """True when a calculation (``a op b = c``), right or not, precedes the last ``#### N``."""
    before = text.rsplit("####", 1)[0] if has_answer_format(text) else text
    return _CALCULATION.search(before) is not None


@reward("gsm8k", timeout=5.0, default=0.0, range=(0.0, 1.0), metrics=grade,
        rates=("accuracy", "accuracy_lenient", "format", "work_shown"))
def gsm8k(completion: str, *, answer: str, format_weight: float = 0.0,
          require_work: bool = False) -> float:
    """1 for the right final number, else 0. With `format_weight` w in [0, 1]:
    ``(1 - w) * correct + w * has_answer_format``, denser, but a policy can game it by printing
    '#### <any number>'. With `require_work`, both credits only after `shows_work`, so the format
    credit asks for a calculation too. `answer`: a number or a GSM8K solution."""
    w = min(max(float(format_weight), 0.0), 1.0)
    reference = extract_answer(answer)
    correct = reference is not None and extract_answer(completion) == reference
    formatted = has_answer_format(completion)
    if require_work and not shows_work(completion):
        correct = formatted = False
    return (1.0 - w) * float(correct) + w * float(formatted)
