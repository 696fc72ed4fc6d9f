"""The reasoning-gym reward: the task's own `score_answer` on the answer taken from a completion.

The answer is taken from a completion like this (the *strict* answer):
1. the text inside the last ``<answer>...</answer>``, if the completion has one;
2. else, when the reference answer is a number, the last number in the completion
   (``The answer is 8.`` -> ``8``);
3. else the completion's last non-empty line, without a trailing period.
The task's `score_answer` then scores it (reasoning-gym's verifiers give 1.0 for a correct
answer; some give partial credit). `grade` also reports the *lenient* score: the best score of
any number, word or line in the completion, i.e. the right answer written anywhere. A strict score that
rises while the lenient one does not is format learning, not problem solving.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from areal_flow.reward import reward

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"\w+")


def _is_number(text: str) -> bool:
    return _NUMBER.fullmatch(text.strip()) is not None


def extract_answer(completion: str, reference: str) -> str | None:
    """The strict answer of `completion` by the rules in the module docstring, or None."""
    tagged = _TAGGED.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if _is_number(reference):
        numbers = _NUMBER.findall(completion)
        return numbers[-1] if numbers else None
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1].removesuffix(".").strip() if lines else None


def _candidates(completion: str) -> set[str]:
    """Every number, word and non-empty line of a completion: what the lenient score tries."""
    lines = {line.strip().removesuffix(".") for line in completion.splitlines() if line.strip()}
    return set(_NUMBER.findall(completion)) | set(_WORD.findall(completion)) | lines


@functools.cache
def _scorer(task: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


def _score(answer: str | None, entry: dict[str, Any]) -> float:
    if answer is None:
        return 0.0
    return float(_scorer(entry["metadata"]["source_dataset"])(answer, entry))


def grade(completion: str, answer: dict[str, Any], **_: object) -> dict[str, float]:
    """Strict ("accuracy": full credit for the strict answer) and lenient ("accuracy_lenient":
    full credit for any candidate) correctness, and "format": the completion had an answer;
    `answer` is the reasoning-gym entry. The reward's `metrics`: the panel's numbers."""
    entry = answer
    strict = extract_answer(completion, str(entry["answer"]))
    strict_score = _score(strict, entry)
    lenient = max((_score(c, entry) for c in _candidates(completion)), default=0.0)
    return {"accuracy": float(strict_score >= 1.0),
            "accuracy_lenient": float(max(strict_score, lenient) >= 1.0),
            "format": float(strict is not None)}


@reward("reasoning_gym", timeout=10.0, default=0.0, range=(0.0, 1.0), metrics=grade,
        rates=("accuracy", "accuracy_lenient", "format"))
def reasoning_gym(completion: str, *, answer: dict[str, Any]) -> float:
    """The task's `score_answer` of the strict answer; `answer` is the reasoning-gym entry
    (question, answer, metadata), as in the rows of areal_flow/data/reasoning_gym.py."""
    return _score(extract_answer(completion, str(answer["answer"])), answer)
