"""`areal-flow eval`: the unbiased pass@k, an end-to-end run on the tiny model (printed table,
jsonl, summary, no trainer built), and bad input refused before any model loads."""

from __future__ import annotations

import itertools
import json
import math
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow import cli
from areal_flow.evaluation import EvalConfig, ks, pass_at_k
from tests.helpers import ROOT, run_cli

TEXT_HASH = "tests.rewards_for_tests:text_hash"  # a score in [0, 1) that varies with the text


def enumerated_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The fraction of k-subsets of n samples (c of them correct) that hold a correct one."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@st.composite
def n_c_k(draw, max_n: int):
    n = draw(st.integers(1, max_n))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@given(n_c_k(8))
@settings(max_examples=300, deadline=None)
def test_pass_at_k_is_the_fraction_of_k_subsets_holding_a_correct_sample(nck):
    assert pass_at_k(*nck) == pytest.approx(float(enumerated_pass_at_k(*nck)), abs=1e-12)


@given(n_c_k(200))
@settings(max_examples=300, deadline=None)
def test_pass_at_k_matches_its_binomial_definition(nck):
    n, c, k = nck
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-9)


@given(st.integers(1, 64), st.data())
def test_pass_at_k_at_the_edges(n, data):
    k = data.draw(st.integers(1, n))
    assert pass_at_k(n, 0, k) == 0.0  # nothing correct
    assert pass_at_k(n, n, k) == 1.0  # everything correct
    assert pass_at_k(n, data.draw(st.integers(1, n)), n) == 1.0  # k = n: any correct one
    assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)


def test_k_beyond_the_samples_is_refused():
    with pytest.raises(ValueError, match="k"):
        pass_at_k(4, 2, 5)
    with pytest.raises(ValueError, match=r"--k 8: .*--samples \(4\)"):
        EvalConfig(samples=4, k=(2, 8))
    assert ks(EvalConfig(samples=4)) == [1, 2, 4]
    assert ks(EvalConfig(samples=6)) == [1, 2, 4, 6]
    assert ks(EvalConfig(samples=1)) == [1]


def printed(stdout: str, label: str) -> list[float]:
    """The numbers of the table row `label` (the 95% interval's included)."""
    line = next(line for line in stdout.splitlines() if line.startswith(f"│ {label} "))
    return [float(x) for x in re.findall(r"\d+\.\d+", line)]


def test_eval_on_the_tiny_model_prints_and_writes_what_its_rows_give(tiny_model_dir, gsm8k_file,
                                                                      tmp_path):
    out = tmp_path / "evals" / "tiny.jsonl"
    result = run_cli("eval", "--model", str(tiny_model_dir), "--dataset", str(gsm8k_file),
                     "--split", "all", "--limit", "4", "--samples", "4", "--max-new-tokens", "16",
                     "--reward", TEXT_HASH, "--correct-at", "0.5", "--out", str(out),
                     paths=(ROOT,))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads((tmp_path / "evals" / "tiny.summary.json").read_text())
    rows = [json.loads(line) for line in gsm8k_file.read_text().splitlines()]

    # the jsonl: one line per row, the row itself, what was scored, per-row pass@k
    from tests.rewards_for_tests import text_hash
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert r["row"] in rows
        assert r["reward"] == text_hash(r["completion"])  # the greedy completion was scored
        assert len(r["sampled_rewards"]) == 4 and r["sampled_missing"] == 0
        assert r["correct"] == sum(x >= 0.5 for x in r["sampled_rewards"])
        assert r["pass@k"] == {str(k): pass_at_k(4, r["correct"], k) for k in (1, 2, 4)}
        assert 1 <= r["length"] <= 16 and r["truncated"] == (r["length"] == 16)

    # the summary, recomputed from the jsonl
    def mean(values):
        return sum(values) / len(values)

    assert summary["rows"] == 4 and summary["correct"] == "reward >= 0.5"
    greedy, sampled = summary["greedy"], summary["sampled"]
    assert greedy["pass@1"] == mean([r["reward"] >= 0.5 for r in records])
    assert greedy["reward_mean"] == pytest.approx(mean([r["reward"] for r in records]))
    assert greedy["length_max"] == max(r["length"] for r in records)
    lengths = sorted(x for r in records for x in r["sampled_lengths"])
    assert sampled["length_p50"] == (lengths[7] + lengths[8]) / 2
    assert sampled["reward_mean"] == pytest.approx(
        mean([x for r in records for x in r["sampled_rewards"]]))
    for k in ("1", "2", "4"):
        assert sampled["pass@k"][k] == pytest.approx(mean([r["pass@k"][k] for r in records]))
    # the rows make pass@k non-trivial: more samples solve more rows
    assert 0 < sampled["pass@k"]["1"] < sampled["pass@k"]["4"]

    # the printed table shows the same numbers and says what counts as correct
    assert "correct = reward >= 0.5" in result.stdout
    assert printed(result.stdout, "pass@1") == pytest.approx(
        [greedy["pass@1"], *greedy["pass@1_ci95"], sampled["pass@k"]["1"]], abs=5e-4)
    assert printed(result.stdout, "pass@4") == pytest.approx([sampled["pass@k"]["4"]], abs=5e-4)
    assert printed(result.stdout, "mean reward") == pytest.approx(
        [greedy["reward_mean"], sampled["reward_mean"]], abs=5e-4)


def test_eval_builds_no_trainer_and_reports_the_tasks_metrics(tiny_model_dir, gsm8k_file,
                                                               tmp_path, monkeypatch, capsys):
    """In-process: building a TrainEngine or any optimizer fails the run, and the pool sees
    exactly one greedy and --samples sampled generations per row (no training rollouts)."""
    import torch

    from areal_flow.inference.local import LocalEngine
    from areal_flow.runtime import engine

    def refuse(*args, **kwargs):
        raise AssertionError("eval built a trainer")

    monkeypatch.setattr(engine.TrainEngine, "__init__", refuse)
    monkeypatch.setattr(torch.optim.Optimizer, "__init__", refuse)
    temperatures = []
    generate = LocalEngine.generate

    async def counted(self, request):
        temperatures.append(request.sampling.temperature)
        return await generate(self, request)

    monkeypatch.setattr(LocalEngine, "generate", counted)
    out = tmp_path / "gsm8k.jsonl"
    assert cli.main(["eval", "--model", str(tiny_model_dir), "--dataset", str(gsm8k_file),
                     "--split", "all", "--limit", "3", "--samples", "2", "--temperature", "0.7",
                     "--max-new-tokens", "8", "--out", str(out)]) == 0
    assert sorted(temperatures) == [0.0] * 3 + [0.7] * 6
    summary = json.loads(out.with_name("gsm8k.summary.json").read_text())
    # the gsm8k reward's own metrics, averaged over the greedy episodes
    metrics = summary["greedy"]["metrics"]
    assert {"accuracy", "format", "work_shown"} <= set(metrics)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert metrics["format"] == sum(r["metrics"]["format"] for r in records) / 3
    assert "format" in capsys.readouterr().out


@pytest.mark.faults
@pytest.mark.parametrize("args, message", [
    (["--workflow", "rlvx"], "rlvx"),
    (["--reward", "gsm8kk"], "gsm8kk"),
    (["--inference.backend", "sglangg"], "sglangg"),
    (["--model", "/no/such/model"], "--model /no/such/model: no such folder"),
    (["--dataset", "/no/such/rows.jsonl"], "--dataset /no/such/rows.jsonl: no such file"),
    (["--split", "eval", "--eval-size", "0"], "--split eval: no rows"),
    (["--split", "eval"], "--split eval: --eval-size 64 takes all 24 rows"),
])
def test_bad_input_is_refused_by_name_before_any_model_loads(args, message, tiny_model_dir,
                                                              gsm8k_file, monkeypatch, capsys):
    from areal_flow.inference.local import LocalEngine

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(LocalEngine, "__init__", refuse)
    base = {"--model": str(tiny_model_dir), "--dataset": str(gsm8k_file), "--split": "all"}
    base.update(zip(args[::2], args[1::2]))
    assert cli.main(["eval", *itertools.chain(*base.items())]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.faults
@pytest.mark.parametrize("args, message", [
    (["--samples", "0"], "'samples' must be >= 1"),
    (["--samples", "4", "--k", "1", "8"], "--k 8: pass@k needs 1 <= k <= --samples (4)"),
])
def test_bad_samples_or_k_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", *args])
    assert exit_.value.code == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())


@pytest.mark.faults
def test_an_unknown_workflow_exits_2_with_one_line_and_no_traceback():
    result = run_cli("eval", "--workflow", "no_such_workflow", check=False)
    assert result.returncode == 2
    assert "no_such_workflow" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_row_record_holds_the_whole_exchange_after_the_prompt(tiny_model_dir):
    """An agent's record shows what the model saw between its turns (a tool's result), in
    order and marked, where `completion` joins the model's turns alone."""
    from transformers import AutoTokenizer

    from areal_flow.evaluation import row_record
    from areal_flow.types import Completion, Episode

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = {text: tok.encode(text, add_special_tokens=False)
           for text in ("What is 2+3?", "call add(2, 3)", " result: 5 ", "it is 5")}

    def said(text):
        n = len(ids[text])
        return Completion(token_ids=ids[text], logprobs=[0.0] * n, versions=[0] * n,
                          finish_reason="stop")

    episode = Episode.start(ids["What is 2+3?"], said("call add(2, 3)"), reward=1.0)
    episode.add_tokens(ids[" result: 5 "]).add(said("it is 5"))
    record = row_record(0, {"question": "q"}, [episode], [], EvalConfig(samples=1), tok)
    assert record["transcript"] == [{"model": True, "text": "call add(2, 3)"},
                                    {"model": False, "text": " result: 5 "},
                                    {"model": True, "text": "it is 5"}]
    assert record["completion"] == tok.decode(ids["call add(2, 3)"] + ids["it is 5"])
