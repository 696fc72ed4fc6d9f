"""The `verifiers` workflow runs a real verifiers (v1) environment, tests/verifiers_envs/
tiny_reverse, through the OpenAI-compatible endpoint: one rollout on a scripted pool holds
exactly the pool's tokens and the rubric's reward, and the GRPO recipe trains the environment
on the tiny model."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="pip install 'areal-flow[verifiers]'")
pytest.importorskip("verifiers", reason="pip install 'areal-flow[verifiers]'")

from areal_flow.types import SamplingParams
from areal_flow.workflow.context import RolloutContext
from areal_flow.agents.openai_endpoint import OpenAIEndpoint
from areal_flow.agents.verifiers_env import VerifiersConfig, verifiers
from tests.helpers import metrics, run_recipe
from tests.test_openai_endpoint import ScriptedPool

ENVS = Path(__file__).resolve().parent / "verifiers_envs"


@pytest.fixture(scope="module", autouse=True)
def installed_env():
    """tiny_reverse importable, as an installed verifiers environment package is."""
    sys.path.insert(0, str(ENVS))
    yield
    sys.path.remove(str(ENVS))


def rollout(pool, row, **config):
    """One episode of the workflow on `pool`."""
    tokenizer = pool.tokenizer
    endpoint = OpenAIEndpoint()
    ctx = RolloutContext(pool=pool, tokenizer=tokenizer, score=None, episode_id="0/0/0",
                         sampling=SamplingParams(max_new_tokens=16), seed=3, endpoint=lambda: endpoint,
                         config=VerifiersConfig(environment="tiny-reverse", **config))

    async def run():
        try:
            return await verifiers(ctx, row)
        finally:
            ctx.close()
            await endpoint.close()

    return asyncio.run(run())


@pytest.mark.parametrize(("row", "word"), [
    ({"idx": 2}, "stone"),  # the taskset's third task
    ({"prompt": "Reverse the text: stone", "answer": "enots"}, "stone"),  # the task's own data
])
def test_one_rollout_holds_the_pools_tokens_and_the_rubrics_reward(tokenizer, row, word):
    pool = ScriptedPool(tokenizer, ["enotsx"])
    episode = rollout(pool, row)
    (request,), (served,) = pool.requests, pool.served
    question = [{"role": "user", "content": f"Reverse the text: {word}"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True,
                                           tokenize=True)["input_ids"]
    assert list(request.input_ids) == prompt
    assert episode.token_ids == [*prompt, *served.token_ids]
    assert episode.loss_mask == [False] * len(prompt) + [True] * len(served.token_ids)
    assert episode.logprobs[len(prompt):] == list(served.logprobs)
    assert episode.versions[len(prompt):] == list(served.versions)
    # "enotsx" against "enots": 5 shared letters over 6 characters, lengths 1 apart over 6 (weight
    # 0.5), not exact (weight 2)
    assert episode.reward == pytest.approx(5 / 6 + 0.5 * 5 / 6)
    assert episode.metrics == pytest.approx({"chars": 5 / 6, "length": 5 / 6, "exact": 0.0,
                                             "reply_chars": 6.0})
    assert episode.info["verifiers"]["environment"] == "tiny-reverse"
    assert episode.info["openai"] == {"calls": 1, "trained_calls": 1, "rewrote_history": False,
                                      "rerendered": 0}


def test_the_exact_bonus_its_weight_and_sampling_overrides_reach_the_pool(tokenizer):
    pool = ScriptedPool(tokenizer, ["enots"])
    episode = rollout(pool, {"idx": 2}, env_kwargs={"num_tasks": 3},
                      sampling={"temperature": 0.5, "max_tokens": 12})
    assert episode.reward == pytest.approx(1.0 + 0.5 * 1.0 + 2.0 * 1.0)
    assert episode.metrics == pytest.approx({"chars": 1.0, "length": 1.0, "exact": 1.0,
                                             "reply_chars": 5.0})
    sampling = pool.requests[0].sampling
    assert (sampling.temperature, sampling.max_new_tokens) == (0.5, 12)
    with pytest.raises(IndexError, match="the taskset has 3 tasks"):
        rollout(ScriptedPool(tokenizer, ["x"]), {"idx": 3}, env_kwargs={"num_tasks": 3})


def test_a_failed_verifiers_rollout_is_raised_with_its_cause(tokenizer):
    class DeadPool(ScriptedPool):
        async def generate(self, request):
            raise ValueError("the pool is down")

    with pytest.raises(RuntimeError, match="'tiny-reverse' failed: ProviderError: upstream 400"
                                           ".*the pool is down"):
        rollout(DeadPool(tokenizer, []), {"idx": 0})


def test_a_config_naming_no_environment_a_missing_one_or_a_bad_field_fails_at_once():
    with pytest.raises(ValueError, match="needs 'environment'"):
        VerifiersConfig()
    with pytest.raises(ModuleNotFoundError, match="taskset 'no-such-env' not found"):
        VerifiersConfig(environment="no-such-env")
    with pytest.raises(ValueError, match="num_taskz"):
        VerifiersConfig(environment="tiny-reverse", env_kwargs={"num_taskz": 3})


def test_the_recipe_trains_a_verifiers_environment(tiny_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"idx": i}) + "\n" for i in range(16)))
    run_dir = tmp_path / "run"
    result = run_recipe("gsm8k_grpo.py", [
        "--workflow", "verifiers", "--workflow-config", '{"environment": "tiny-reverse"}',
        "--model", str(tiny_model_dir), "--dataset", str(rows), "--run-dir", str(run_dir),
        "--steps", "2", "--eval-size", "4", "--eval-every", "2", "--rollout.batch-size", "2",
        "--rollout.group-size", "2", "--sampling.max-new-tokens", "8",
        "--inference.dtype", "float32", "--train.dtype", "float32", "--train.optim.lr", "1e-3"],
        paths=(ENVS,))
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(" chars " in line for line in steps), steps
    trained = [m for m in metrics(run_dir) if m["step"] > 0]
    assert len(trained) == 2
    assert all(m["train/skipped_rows"] < 2 and m["grad_norm"] > 0 for m in trained), trained
    assert all(m["task_metrics"] == ["chars", "exact", "length", "reply_chars"] for m in trained)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["info"]["verifiers"]["environment"] == "tiny-reverse"
                           for s in samples)
