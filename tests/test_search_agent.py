"""examples/plugins/search_agent, installed for real with pip: its reward's F1 against an
independent reference and its SQuAD normalisation, the BM25 retriever's ranking and the data's
determinism, the tool-call loop's segments on scripted model replies, and the plugin trained by
the generic recipe."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from areal_flow.testing.contract import check_reward
from areal_flow.testing.strategies import answered
from areal_flow.types import SamplingParams
from areal_flow.workflow.context import RolloutContext
from tests.helpers import (ScriptedPool, install_plugin, metrics, needs, plugin_rows, run_cli,
                           run_python, run_recipe)

PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "plugins" / "search_agent"


@pytest.fixture(scope="session")
def search_site(tmp_path_factory) -> Path:
    """examples/plugins/search_agent installed with pip into a folder of its own."""
    return install_plugin("search_agent", tmp_path_factory.mktemp("search_site"))


@pytest.fixture(scope="module")
def sa(search_site):
    """The installed `search_agent` module (importable by the reward workers too)."""
    sys.path.insert(0, str(search_site))
    try:
        yield importlib.import_module("search_agent")
    finally:
        sys.path.remove(str(search_site))


# ----------------------------------------------------------------------------------- packaging


def test_the_installed_plugin_is_listed(search_site):
    cells = plugin_rows(search_site, "search")
    dist = "areal-flow-search-agent 0.1.0"
    assert sorted(cells) == sorted([["workflow", "search.agent", dist, "search_agent:agent"],
                                    ["reward", "search.answer", dist,
                                     "search_agent:answer_score"]])
    out = run_python(  # what a reward worker does: no torch, no bm25s until a search runs
        """
        import sys
        from areal_flow import rewards, workflows
        spec = rewards.spec("search.answer")
        print(spec.fn("so <answer>The Elm.</answer>", answer="elm"), spec.metrics.__name__,
              workflows.spec("search.agent").config.__name__,
              [m for m in ("torch", "bm25s") if m in sys.modules])
        """,
        search_site,
    )
    assert out.stdout.split() == ["1.0", "answer_metrics", "SearchConfig", "[]"]


def test_the_dataset_command_and_the_corpus_are_deterministic(sa, tmp_path):
    # the README's command, from a fresh interpreter with the plugin's folder on PYTHONPATH
    path = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, "-m", "search_agent", str(path), "--rows", "300"],
                   check=True, env={**os.environ, "PYTHONPATH": str(PLUGIN)}, capture_output=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == sa.make_rows(300, seed=0)  # the same questions in another process
    assert rows[:264] != sa.make_rows(264, seed=1) and len({r["question"] for r in rows}) == 264
    corpus = subprocess.run([sys.executable, "-c", "import json, search_agent as s; "
                             "print(json.dumps(s.CORPUS))"], check=True, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(PLUGIN)}).stdout
    assert json.loads(corpus) == sa.CORPUS and len(sa.CORPUS) == 96
    assert sa.CORPUS[0] == ("The river Thandsoun rises in the Drerfun Hills and is 232 "
                            "kilometres long.")  # a changed generator changes every dataset


def test_each_question_is_answered_by_exactly_one_passage(sa):
    for row in sa.make_rows(264, seed=5):
        assert set(row) == {"question", "answer", "passage"}
        names = re.findall(r"\b[A-Z][a-z]+\b", row["question"])[1:]  # past the first word
        assert names, row
        holding = [i for i, text in enumerate(sa.CORPUS)
                   if row["answer"] in text and all(re.search(rf"\b{n}\b", text) for n in names)]
        assert holding == [row["passage"]], (row, holding)


# ----------------------------------------------------------------------------------- retriever


@needs("bm25s", "agents")  # the example's retriever
def test_bm25_ranks_the_gold_passage_first_for_the_questions(sa):
    rows = sa.make_rows(264, seed=0)
    first = sum(sa.search(row["question"], 3)[:1] == [row["passage"]] for row in rows)
    assert first / len(rows) >= 0.95  # observed: 264 of 264
    # the query matters: a city's name alone competes with the people born there
    cities = [r for r in rows if "founded?" in r["question"]]
    alone = sum(sa.search(re.findall(r"of (\w+) founded", r["question"])[0], 1) ==
                [r["passage"]] for r in cities)
    assert 0.15 <= alone / len(cities) <= 0.6  # observed: 11 of 36
    hits = sa.search("river Thandsoun Drerfun Hills", 5)
    assert hits[0] == 0 and len(hits) == 5 and len(set(hits)) == 5
    assert sa.search("", 3) == [] and sa.search("zzqx the of", 3) == []  # no shared word
    assert len(sa.search("river", 100)) == 24 + 36  # only the passages with the word


# ----------------------------------------------------------------------------------- reward

WORDS = st.sampled_from("elm salt 1432 hills river dunmar north old grey x y".split())


def reference_f1(pred: list[str], gold: list[str]) -> float:
    """Token F1 by hand: match each predicted token to an unused equal gold token."""
    if not pred or not gold:
        return float(pred == gold)
    unused, same = list(gold), 0
    for token in pred:
        if token in unused:
            unused.remove(token)
            same += 1
    return 0.0 if same == 0 else 2 * same / (len(pred) + len(gold))


@st.composite
def decorated(draw, tokens: list[str]) -> str:
    """`tokens` as a model might write them: any case, punctuation, articles, extra spaces, all
    of which the normalisation drops (so the F1 of the text is the F1 of `tokens`)."""
    out = []
    for token in tokens:
        if draw(st.booleans()):
            out.append(draw(st.sampled_from(["a", "An", "THE", "the", ",", "--", "(the)"])))
        token = "".join(c.upper() if draw(st.booleans()) else c for c in token)
        out.append(token + draw(st.sampled_from(["", ",", ".", "!", "?", "-", '"'])))
    return draw(st.sampled_from([" ", "  ", "\n"])).join(out)


def matches_reference(f1):
    """A hypothesis test: `f1` of decorated token lists equals `reference_f1` of the lists."""
    @settings(max_examples=300, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink])  # no slow "explain"
    @given(st.data(), st.lists(WORDS, max_size=6), st.lists(WORDS, max_size=6))
    def check(data, pred, gold):
        written, reference = data.draw(decorated(pred)), data.draw(decorated(gold))
        assert f1(written, reference) == pytest.approx(reference_f1(pred, gold)), \
            (written, reference)

    return check


def test_token_f1_matches_an_independent_reference(sa):
    matches_reference(sa.token_f1)()


def test_the_reference_catches_an_f1_that_counts_repeated_tokens_twice(sa):
    def set_f1(prediction, gold):  # the bug: overlap by membership, not by multiset
        pred, ref = sa.normalize(prediction).split(), sa.normalize(gold).split()
        if not pred or not ref:
            return float(pred == ref)
        same = sum(t in ref for t in pred)
        return 0.0 if same == 0 else 2 * same / (len(pred) + len(ref))

    with pytest.raises(AssertionError):
        matches_reference(set_f1)()


@pytest.mark.parametrize(("written", "gold", "exact"), [
    ("The Dunmar Hills", "Dunmar Hills", 1.0), ("dunmar hills.", "Dunmar Hills", 1.0),
    ("1,432", "1432", 1.0), ("  an  Elm! ", "elm", 1.0), ("A glassblower", "glassblower", 1.0),
    ("theatre", "atre", 0.0), ("Dunmar", "Dunmar Hills", 0.0), ("1433", "1432", 0.0),
    ("Elm river", "river Elm", 0.0), ("", "elm", 0.0), ("the", "", 1.0),
])
def test_exact_match_normalises_as_squad(sa, written, gold, exact):
    assert sa.answer_score(f"I think <answer>{written}</answer>", answer=gold) == exact
    assert sa.answer_metrics(f"<answer>{written}</answer>", answer=gold)["exact"] == exact


def test_the_last_answer_counts_and_f1_weight_mixes(sa):
    score = sa.answer_score
    assert score("<answer>1431</answer> no: <answer>1432</answer>", answer="1432") == 1.0
    assert score("<answer>1432</answer> no: <answer>1431</answer>", answer="1432") == 0.0
    assert score("1432", answer="1432") == 0.0  # no tags
    assert sa.answer_metrics("no tags", answer="x") == {"exact": 0.0, "f1": 0.0}
    assert sa.answer_metrics("<answer>Dunmar</answer>", answer="Dunmar Hills") == \
        {"exact": 0.0, "f1": pytest.approx(2 / 3)}
    assert score("<answer>Dunmar</answer>", answer="Dunmar Hills", f1_weight=0.5) == \
        pytest.approx(1 / 3)
    assert score("<answer>Dunmar</answer>", answer="Dunmar Hills", f1_weight=1.0) == \
        pytest.approx(2 / 3)
    assert score("<answer>dunmar hills</answer>", answer="Dunmar Hills", f1_weight=0.3) == 1.0


def test_the_reward_passes_the_contract(sa):
    for examples in (None, answered(("answer_tag",))):
        report = check_reward("search.answer", examples=examples)
        assert report.ok, report.summary()


# ----------------------------------------------------------------------------------- workflow


@pytest.fixture(scope="module")
def runner(sa):
    from areal_flow.reward.runner import RewardRunner

    with RewardRunner(max_workers=1) as r:  # its workers import search_agent via sys.path
        yield r


def play(sa, tokenizer, runner, sample, replies, config=None):
    from areal_flow import workflows

    pool = ScriptedPool(tokenizer, [r if isinstance(r, tuple) else (r, "stop") for r in replies])
    ctx = RolloutContext(pool=pool, tokenizer=tokenizer, score=runner.score,
                         sampling=SamplingParams(max_new_tokens=32), episode_id="0/0/0",
                         config=config)
    episode = asyncio.run(workflows.get("search.agent")(ctx, sample))
    segments = [(s.trainable, tokenizer.decode(s.token_ids)) for s in episode.segments]
    return episode, segments, pool, ctx.metrics


def founded(sa) -> dict:
    return next(r for r in sa.FACTS if "founded?" in r["question"])


def shown(sa, hits: list[int]) -> str:
    return "\n<information>\n" + "\n".join(
        f"[{i + 1}] {sa.CORPUS[h]}" for i, h in enumerate(hits)) + "\n</information>\n"


@needs("bm25s", "agents")  # the example's retriever
def test_a_search_then_an_answer(sa, tokenizer, runner):
    row = founded(sa)  # "In which year was the city of Sendskisk founded?"
    city = re.findall(r"of (\w+) founded", row["question"])[0]
    episode, segments, pool, reward_metrics = play(sa, tokenizer, runner, row, [
        f"Let me look. <search>{city} founded</search> and it was 1200",  # cut after </search>
        f"<answer>{row['answer']}</answer>"])
    hits = sa.search(f"{city} founded", 3)
    assert hits[0] == row["passage"] and len(hits) == 3
    assert segments == [
        (False, f"<|im_start|>system\n{sa.SYSTEM}<|im_end|>\n<|im_start|>user\n"
                f"{row['question']}<|im_end|>\n<|im_start|>assistant\n"),
        (True, f"Let me look. <search>{city} founded</search>"),  # the model's call: trained
        (False, shown(sa, hits)),  # the environment's passages: not trained on
        (True, f"<answer>{row['answer']}</answer><|im_end|>"),
    ]
    assert f"[1] {sa.CORPUS[row['passage']]}" in segments[2][1]
    assert episode.reward == 1.0 and not episode.truncated
    assert reward_metrics == {"exact": 1.0, "f1": 1.0}
    assert episode.metrics == {"searches": 1, "retrieved": 1.0}
    assert episode.info == {"queries": [f"{city} founded"], "shown": sorted(hits)}
    # the second turn continues exactly the tokens of the first, passages included
    assert len(pool.prompts) == 2
    assert pool.prompts[1] == episode.token_ids[: -len(episode.segments[-1].token_ids)]


@needs("bm25s", "agents")  # the example's retriever
@pytest.mark.parametrize(("replies", "config", "trained", "searches", "retrieved", "reward"), [
    # no search: an answer from the prior (wrong here)
    (["<answer>1500</answer>"], None, [True], 0, 0.0, 0.0),
    # a query with no word in the corpus: "No results.", then a guess
    (["<search>zzqx</search>", "<answer>1500</answer>"], None, [True, False, True], 1, 0.0, 0.0),
    # the answer turn cut off at its token budget: the episode ends there, truncated
    (["<search>QUERY</search>", ("<answer>15", "length")], None, [True, False, True], 1, 1.0,
     0.0),
    # cut off while writing the call: no search runs
    ([("<search>QUE", "length")], None, [True], 0, 0.0, 0.0),
    # a second search past max_searches=1 ends the episode unanswered
    (["<search>zzqx</search>", "<search>QUERY</search>", "<answer>ANSWER</answer>"],
     {"max_searches": 1}, [True, False, True], 1, 0.0, 0.0),
    # two searches, the second finds it; F1 weight on a right answer
    (["<search>zzqx</search>", "<search>QUERY</search>", "<answer>the ANSWER.</answer>"],
     {"f1_weight": 0.5, "top_k": 1}, [True, False, True, False, True], 2, 1.0, 1.0),
    # no tool call at all, the turn just ends: no answer
    (["I do not know."], None, [True], 0, 0.0, 0.0),
])
def test_episode_outcomes(sa, tokenizer, runner, replies, config, trained, searches, retrieved,
                          reward):
    row = founded(sa)
    query = re.findall(r"of (\w+) founded", row["question"])[0] + " founded"
    replies = [(r[0].replace("QUERY", query), r[1]) if isinstance(r, tuple)
               else r.replace("QUERY", query).replace("ANSWER", row["answer"]) for r in replies]
    cfg = sa.SearchConfig(**(config or {}))
    episode, segments, pool, _ = play(sa, tokenizer, runner, row, replies, cfg)
    assert [t for t, _ in segments] == [False, *trained]
    assert episode.metrics == {"searches": searches, "retrieved": retrieved}
    assert episode.reward == reward
    assert episode.truncated == isinstance(replies[len(pool.prompts) - 1], tuple)
    if "zzqx" in replies[0]:
        assert segments[2][1] == "\n<information>\nNo results.\n</information>\n"
    if cfg.top_k == 1 and searches == 2:
        assert segments[4][1] == shown(sa, [row["passage"]])


def test_f1_weight_reaches_the_reward_and_rows_without_a_passage(sa, tokenizer, runner):
    row = next(r for r in sa.FACTS if "hills" in r["question"])
    sample = {"question": row["question"], "answer": row["answer"]}  # no `passage`
    episode, _, _, reward_metrics = play(sa, tokenizer, runner, sample,
                                         [f"<answer>{row['answer'].split()[0]}</answer>"],
                                         sa.SearchConfig(f1_weight=0.5))
    assert episode.reward == pytest.approx(1 / 3)
    assert reward_metrics == {"exact": 0.0, "f1": pytest.approx(2 / 3)}
    assert episode.metrics == {"searches": 0}


# ----------------------------------------------------------------------------------- training


def tiny_run(model: Path, rows: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--dataset", str(rows), "--run-dir", str(run_dir),
            "--steps", "2", "--eval-size", "4", "--eval-every", "2", "--rollout.batch-size", "2",
            "--rollout.group-size", "2", "--sampling.max-new-tokens", "8",
            "--inference.dtype", "float32", "--train.dtype", "float32", "--train.optim.lr", "1e-3",
            "--workflow", "search.agent", "--algorithm", "grpo", *extra]


def test_the_generic_recipe_trains_the_search_agent(sa, search_site, tiny_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in sa.make_rows(16, seed=1)))
    run = tmp_path / "agent"
    result = run_recipe("gsm8k_grpo.py", tiny_run(tiny_model_dir, rows, run),
                        paths=(search_site,))
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2
    for name in ("exact", "f1", "retrieved", "searches"):
        assert all(f" {name} " in line for line in steps), (name, steps)
    assert " eval exact " in steps[1]
    trained = [m for m in metrics(run) if m["step"] > 0]
    assert [m["task_metrics"] for m in trained] == [["exact", "f1", "retrieved", "searches"]] * 2
    assert {"eval/exact", "eval/f1", "eval/searches", "eval/retrieved"} <= set(trained[1])
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert set(samples[0]["metrics"]) == {"exact", "f1", "retrieved", "searches"}
    assert all(len(s["info"]["queries"]) == s["metrics"]["searches"] for s in samples)

    # the tiny model never answers, so every group above was flat; a reward with spread shows
    # the updates running through the agent's episodes
    spread = tmp_path / "spread"
    run_recipe("gsm8k_grpo.py", tiny_run(tiny_model_dir, rows, spread, "--reward",
                                         "tests.rewards_for_tests:completion_length"),
               paths=(search_site,))
    trained = [m for m in metrics(spread) if m["step"] > 0]
    assert all(m["train/skipped_rows"] < 4 and m["grad_norm"] > 0 for m in trained), trained
