"""A search agent as an areal_flow plugin, in one file: answer questions about a fictional world
by querying a BM25 search engine over a small packaged encyclopedia.

The model writes ``<search>query</search>``; the generation is cut there, the environment runs
the query and appends the top passages as ``<information>...</information>`` (environment
tokens: context, never trained on), and the model goes on, up to ``max_searches`` times, until it
answers in ``<answer>...</answer>``.

- corpus ``CORPUS``: 96 passages about fictional cities, people and rivers, generated from a
  fixed seed (so no answer can come from a model's prior); ``search(query, k)`` ranks it with
  BM25 (``bm25s``; the index is built once per process);
- data: ``make_rows(n, seed)`` (each question answerable from exactly one passage, whose index
  is the row's ``passage``), or ``python -m search_agent rows.jsonl``;
- reward ``search.answer``: SQuAD exact match of the last <answer>, or with ``f1_weight`` a mix
  with token-level F1; its metrics: ``exact``, ``f1``;
- workflow ``search.agent``: the loop above; ``episode.metrics`` adds ``searches`` and
  ``retrieved`` (the gold passage was among those shown).
"""

from __future__ import annotations

import functools
import json
import random
import re
import string
from collections import Counter

import attrs
from attrs import validators as v

from areal_flow import reward, workflow
from areal_flow.workflow.context import field

# ----------------------------------------------------------------------------------- corpus

_ONSETS = "b br d dr f g gr h k kr l m n p qu r s sk st t th v w z".split()
_VOWELS = "a e i o u ae ei ou ia".split()
_CODAS = ["", "l", "n", "r", "s", "th", "nd", "rn", "sk", "lt", "m"]
GOODS = "salt wool glass amber copper silk clocks cheese rope paper bells barley".split()
PROFESSIONS = ("glassblower cartographer astronomer shipwright beekeeper weaver composer "
               "apothecary bookbinder clockmaker surveyor falconer").split()


def _build_world(seed: int = 1729) -> tuple[list[str], list[dict]]:
    """(passages, facts): each fact is one question about one passage, with its answer."""
    rng, used = random.Random(seed), set()

    def name(syllables: int = 2) -> str:
        while True:
            word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                           for _ in range(syllables)).capitalize()
            if len(word) >= 5 and word not in used:
                used.add(word)
                return word

    passages, facts = [], []

    def add(text: str, *questions: tuple[str, str]) -> None:
        facts.extend({"question": q, "answer": a, "passage": len(passages)} for q, a in questions)
        passages.append(text)

    rivers, cities = [name() for _ in range(24)], [name() for _ in range(36)]
    for river in rivers:
        hills, km = f"{name()} Hills", str(rng.randint(40, 900))
        add(f"The river {river} rises in the {hills} and is {km} kilometres long.",
            (f"In which hills does the river {river} rise?", hills),
            (f"How many kilometres long is the river {river}?", km))
    for city in cities:
        river, year, good = rng.choice(rivers), str(rng.randint(1100, 1800)), rng.choice(GOODS)
        add(f"{city} is a city on the river {river}. It was founded in {year} and is known for "
            f"its {good}.",
            (f"In which year was the city of {city} founded?", year),
            (f"On which river does the city of {city} lie?", river),
            (f"What is the city of {city} known for?", good))
    for _ in range(36):
        person, job = f"{name()} {name()}", rng.choice(PROFESSIONS)
        city, year = rng.choice(cities), str(rng.randint(1600, 1950))
        add(f"{person} was a {job} born in {city} in {year}.",
            (f"What was the profession of {person}?", job),
            (f"In which city was {person} born?", city),
            (f"In which year was {person} born?", year))
    return passages, facts


CORPUS, FACTS = _build_world()


@functools.cache
def _index():
    import bm25s  # imported on first search: reward workers never need it

    index = bm25s.BM25()
    index.index(bm25s.tokenize(CORPUS, stopwords="en", show_progress=False), show_progress=False)
    return index


def search(query: str, k: int = 3) -> list[int]:
    """Indices into CORPUS of the (at most) `k` best BM25 matches of `query`, best first;
    passages sharing no word with it are left out."""
    import bm25s

    words = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
    if not words[0] or k < 1:
        return []
    docs, scores = _index().retrieve(words, k=min(k, len(CORPUS)), show_progress=False)
    return [int(d) for d, s in zip(docs[0], scores[0]) if s > 0]


# ----------------------------------------------------------------------------------- data


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` rows {question, answer, passage}: the corpus's questions shuffled by `seed` (all of
    them again, reshuffled, when `n` is larger than their number)."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        rows += rng.sample(FACTS, len(FACTS))
    return [dict(row) for row in rows[:n]]


# ----------------------------------------------------------------------------------- reward

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
PUNCTUATION = frozenset(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD's token-level F1 of the normalised texts (1 when both are empty)."""
    pred, ref = normalize(prediction).split(), normalize(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def answer_metrics(completion: str, *, answer: str, **fields) -> dict[str, float]:
    """The panel's numbers: exact match and F1 of the last <answer> (0 without one)."""
    found = ANSWER.findall(completion)
    if not found:
        return {"exact": 0.0, "f1": 0.0}
    return {"exact": float(normalize(found[-1]) == normalize(str(answer))),
            "f1": token_f1(found[-1], str(answer))}


@reward("search.answer", timeout=2.0, default=0.0, range=(0.0, 1.0), metrics=answer_metrics,
        rates=("exact",))  # f1 is a value in [0, 1], not a rate
def answer_score(completion: str, *, answer: str, f1_weight: float = 0.0, **fields) -> float:
    """(1 - f1_weight) * exact match + f1_weight * token F1, of the last <answer>...</answer>
    against `answer` (both normalised as SQuAD does); 0 without an <answer>."""
    found = answer_metrics(completion, answer=answer)
    weight = min(max(float(f1_weight), 0.0), 1.0)
    return (1.0 - weight) * found["exact"] + weight * found["f1"]


# ----------------------------------------------------------------------------------- workflow

SYSTEM = ("Answer the question with the help of a search engine over an encyclopedia. To search, "
          "write <search>your query</search>; the results follow in <information></information>. "
          "Then give only the final answer, as <answer>your answer</answer>.")


@attrs.frozen(kw_only=True)
class SearchConfig:
    """Options of search.agent (--workflow-config; --reward sets `reward`)."""

    reward: str = "search.answer"
    """A registered reward, called as reward(model text, answer=..., f1_weight=...)."""
    question_field: str = "question"
    answer_field: str = "answer"
    passage_field: str = "passage"
    """The gold passage's index in CORPUS, for the `retrieved` metric (optional in a row)."""
    max_searches: int = attrs.field(default=3, validator=v.ge(0))
    """Most searches per episode; a search past them ends the episode unanswered."""
    top_k: int = attrs.field(default=3, validator=v.ge(1))
    """Passages shown per search."""
    f1_weight: float = attrs.field(default=0.0, validator=[v.ge(0.0), v.le(1.0)])
    """Reward = (1 - f1_weight) * exact match + f1_weight * token F1."""


def information(hits: list[int]) -> str:
    """What the environment appends after a search: the passages, numbered."""
    body = "\n".join(f"[{i}] {CORPUS[h]}" for i, h in enumerate(hits, 1)) or "No results."
    return f"\n<information>\n{body}\n</information>\n"


@workflow("search.agent", config=SearchConfig)
async def agent(ctx, sample: dict):
    cfg = ctx.config or SearchConfig()
    answer = field(sample, cfg.answer_field)
    prompt = ctx.chat([{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": field(sample, cfg.question_field)}])
    episode, context, text, queries, shown = ctx.episode(prompt), list(prompt), "", [], set()
    while True:
        out = ctx.stop_at(await ctx.generate(context), "</search>")  # cut after the tool call
        episode.add(out)  # the model's tokens: trained on
        context += out.token_ids
        text += out.text or ""
        call = SEARCH.search(out.text or "")
        # an answer, no call, a turn cut off at its token budget (mid-call: stop_at marks a
        # complete call "stop") or the search budget spent: the episode ends
        if (call is None or ANSWER.search(out.text or "") or out.finish_reason != "stop"
                or len(queries) == cfg.max_searches):
            break
        queries.append(call.group(1).strip())
        hits = search(queries[-1], cfg.top_k)  # a real agent awaits its search API here
        shown.update(hits)
        tokens = ctx.encode(information(hits))
        episode.add_tokens(tokens)  # the environment's tokens: context, never trained on
        context += tokens
    episode.reward = await ctx.reward(cfg.reward, text, answer=answer, f1_weight=cfg.f1_weight)
    episode.metrics["searches"] = len(queries)
    if cfg.passage_field in sample:
        episode.metrics["retrieved"] = float(sample[cfg.passage_field] in shown)
        episode.rates.add("retrieved")  # 0 or 1: eval gives it an interval
    episode.info.update(queries=queries, shown=sorted(shown))
    return episode


if __name__ == "__main__":  # python -m search_agent rows.jsonl [--rows N] [--seed S]
    import argparse

    parser = argparse.ArgumentParser(description="Write search-agent questions as JSON lines.")
    parser.add_argument("path")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in make_rows(args.rows, args.seed))
    print(f"wrote {args.rows} questions over {len(CORPUS)} passages to {args.path}")
