"""reasoning-gym tasks as recipe rows: ``--dataset 'reasoning_gym:<task>[?key=value&...]'``.

reasoning-gym (``pip install 'areal-flow[reasoning-gym]'``) generates ~100 procedural tasks, each
with its own verifier. The keys after ``?`` are the task's config fields (for ``chain_sum``:
``min_terms``, ``max_terms``, ``min_digits``, ``max_digits``, ...; values are read as YAML
scalars), plus ``size`` (training rows, default 10,000) and ``seed`` (default 0).

Rows are ``{"question": <the task's question>, "answer": <the whole reasoning-gym entry>}``: the
entry (question, answer, metadata) is what the task's `score_answer` needs, so the
``reasoning_gym`` reward (areal_flow/reward/reasoning_gym.py) gets it as its `answer`.

Eval rows come from the same config with seed ``seed + size``: reasoning-gym draws problem i from
``Random(seed + i)``, so seed + 1 would repeat the training problems shifted by one. A generated
problem whose question is also a training question, or an earlier eval question, is skipped, so
eval rows are distinct and disjoint from training rows; a config too small to leave that many
fails with the counts. Skipping is not neutral in a small problem space: the problems training
covers (e.g. all 300 two-term one-digit sums) vanish from eval, which then holds the rarer, harder
ones, so the note warns when over 20% of eval draws were training questions.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import unquote

import attrs
import yaml

PREFIX = "reasoning_gym:"
INSTALL = "pip install 'areal-flow[reasoning-gym]'"
TRAIN_SIZE = 10_000
SKEW_WARNING = 0.2
"""Above this fraction of eval draws skipped as training questions, the note warns."""


def parse(spec: str) -> tuple[str, dict[str, Any]]:
    """``reasoning_gym:chain_sum?max_terms=3`` -> ("chain_sum", {"max_terms": 3}). A ``+`` is a
    plus sign (``operators=['+','-']``), not an encoded space as in web forms."""
    task, _, query = spec.removeprefix(PREFIX).partition("?")
    config = {}
    for item in filter(None, query.split("&")):
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"--dataset {spec}: {item!r} is not key=value")
        config[unquote(key)] = yaml.safe_load(unquote(value))
    return task, config


def _module():
    try:
        import reasoning_gym
    except ImportError:
        raise ModuleNotFoundError(f"--dataset {PREFIX}... needs the reasoning-gym package: "
                                  f"{INSTALL}") from None
    return reasoning_gym


def _create(task: str, config: dict[str, Any], *, size: int, seed: int):
    """The task's problems, or an error naming the task list or the config's fields."""
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"--dataset {PREFIX}{task}: no such reasoning-gym task; tasks: "
                         f"{', '.join(sorted(DATASETS))}")
    fields = [f.name for f in dataclasses.fields(DATASETS[task][1])]
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(f"--dataset {PREFIX}{task}: unknown config key(s) {unknown}; "
                         f"{task} takes {sorted(set(fields) - {'size', 'seed'})} and size, seed")
    try:
        return list(_module().create_dataset(task, **config, size=size, seed=seed))
    except (AssertionError, TypeError, ValueError) as error:  # the task's own config checks
        raise ValueError(f"--dataset {PREFIX}{task}: invalid config {config}: {error}") from None


def train_eval_rows(spec: str, eval_size: int) -> tuple[list[dict], list[dict], str]:
    """Training and held-out rows of a task spec, and a line saying where they come from."""
    _module()
    task, config = parse(spec)
    size = int(config.pop("size", TRAIN_SIZE))
    seed = int(config.pop("seed", 0))
    train = [{"question": e["question"], "answer": e} for e in _create(task, config, size=size,
                                                                      seed=seed)]
    training_questions = {row["question"] for row in train}
    seen = set(training_questions)
    evaluation: list[dict] = []
    drawn = in_training = 0
    # asking for 10x the rows leaves room for the problems skipped as already seen
    for entry in _create(task, config, size=max(10 * eval_size, 16), seed=seed + size):
        if len(evaluation) == eval_size:
            break
        drawn += 1
        in_training += entry["question"] in training_questions
        if entry["question"] not in seen:
            seen.add(entry["question"])
            evaluation.append({"question": entry["question"], "answer": entry})
    if len(evaluation) < eval_size:
        raise ValueError(f"--dataset {spec}: only {len(evaluation)} of --eval-size {eval_size} "
                         f"generated eval problems are distinct from the {size:,} training rows "
                         "and each other; lower size or eval-size, or widen the task config")
    note = (f"data: reasoning-gym {task} {config or '(defaults)'}: {len(train):,} train rows "
            f"(seed {seed}), {len(evaluation):,} distinct held-out eval rows (seed {seed + size})")
    if in_training > drawn * SKEW_WARNING:
        # the skipped problems are the likeliest ones: the eval set is not the task's distribution
        note += (f"; WARNING: {in_training / drawn:.0%} of the problems drawn for eval were "
                 "training questions and were skipped, so eval over-represents the problems "
                 "training rarely sees; lower size or widen the task config")
    return train, evaluation, note


@attrs.frozen
class ReasoningGymSource:
    """The ``reasoning_gym`` dataset source (a `DatasetSource`, entry point
    ``areal_flow.dataset_sources``): ``--dataset 'reasoning_gym:<task>?...'``."""

    reward: str = "reasoning_gym"
    prompt_template: str = "{question} Reply with only the final answer."
    """The reward reads the last number or line."""

    def train_eval_rows(self, dataset: str, eval_size: int
                        ) -> tuple[list[dict], list[dict], str]:
        return train_eval_rows(dataset, eval_size)

    def task(self, dataset: str) -> str:
        return parse(dataset)[0]


SOURCE = ReasoningGymSource()
