"""examples/agents/calculator_agent.py, the README's "Train your existing agent": an unchanged
openai tool-calling loop trains through the GRPO recipe, in process and from another process."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers import ROOT, metrics, run_recipe

EXAMPLE = ROOT / "examples" / "agents"


def test_the_calculator_tool_is_arithmetic_and_nothing_else():
    import sys

    sys.path.insert(0, str(EXAMPLE))
    try:
        from calculator_agent import calculate
    finally:
        sys.path.remove(str(EXAMPLE))
    assert calculate("2 + 3 * 4") == "14" and calculate("-(6 / 4)") == "-1.5"
    for bad in ("__import__('os')", "2 ** 8", "1 / 0", "x"):
        assert calculate(bad).startswith("error: ")


@pytest.mark.parametrize("way", ["in_process", "subprocess"])
@pytest.mark.skipif(importlib.util.find_spec("openai") is None,
                    reason="the agent is an openai client: pip install 'areal-flow[agents]'")
def test_the_agent_trains_through_the_recipe(way, tiny_model_dir, gsm8k_file, tmp_path):
    run_dir = tmp_path / "run"
    run_recipe("gsm8k_grpo.py", [
        "--model", str(tiny_model_dir), "--dataset", str(gsm8k_file), "--run-dir", str(run_dir),
        "--workflow", f"train_calculator_agent:{way}", "--steps", "2", "--eval-size", "2",
        "--eval-every", "2", "--rollout.batch-size", "2", "--rollout.group-size", "2",
        "--sampling.max-new-tokens", "8", "--inference.dtype", "float32", "--train.dtype", "float32",
        "--samples-per-step", "4"], paths=(EXAMPLE,))
    trained = [m for m in metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2] and "eval/reward" in trained[-1]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    for sample in samples:  # every episode is the agent's recorded calls
        calls = sample["info"]["openai"]
        assert 1 <= calls["trained_calls"] <= calls["calls"] <= 3
        assert sum(s["trained"] for s in sample["segments"]) == calls["trained_calls"]
        assert "Solve the problem" in sample["prompt"]  # the agent's own system prompt
