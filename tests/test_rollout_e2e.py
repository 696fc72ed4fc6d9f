"""The scheduler with the real local engine, the rlvr workflow and the reward runner."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_flow.config import RolloutConfig
from areal_flow.inference.local import LocalEngine
from areal_flow.reward.runner import RewardRunner
from areal_flow.rollout.scheduler import RolloutScheduler
from areal_flow.types import GenerationRequest, SamplingParams, WeightUpdate

DATA = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(12)]


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(max_workers=1) as r:
        yield r


def test_rlvr_batches_across_weight_updates_keep_exact_token_versions(tiny_model_dir, runner):
    """3 batches with a weight update after each, η = 1, long generations that are in flight at
    the updates: every trained token's behavior logprob equals a forward pass of the weights of
    the version it is tagged with, and no token is older than the staleness limit allows."""
    engine = LocalEngine(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    weights = {0: AutoModelForCausalLM.from_pretrained(tiny_model_dir)}
    config = RolloutConfig(batch_size=1, group_size=2, max_concurrent=2, max_staleness=1,
                           max_prompt_tokens=64)
    scheduler = RolloutScheduler(
        pool=engine, workflow="rlvr", dataset=DATA, tokenizer=tokenizer, score=runner.score,
        config=config, sampling=SamplingParams(max_new_tokens=300, ignore_eos=True,
                                               temperature=1.0), seed=0)
    batches = []
    try:
        with scheduler:
            for step in range(3):
                batch = scheduler.prepare_batch(timeout=120)
                batches.append((scheduler.version, batch))
                model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
                g = torch.Generator().manual_seed(step)
                model.load_state_dict({k: t + 0.02 * torch.randn(t.shape, generator=g)
                                       for k, t in weights[step].state_dict().items()})
                weights[step + 1] = model
                engine.update_weights(WeightUpdate(version=step + 1, state_dict=model.state_dict()))
                scheduler.set_version(step + 1)
            stats = scheduler.stats()
        interruptions = engine.stats()["interruptions"]
    finally:
        engine.close()

    assert interruptions > 0, "the updates were meant to land while episodes were generating"
    mixed = 0
    for version, batch in batches:
        assert batch["input_ids"].shape[0] == 2
        for row in range(2):
            mask = batch["loss_mask"][row]
            tagged = batch["versions"][row][mask]
            assert int(tagged.min()) >= version - 1 and int(tagged.max()) <= version
            mixed += len(set(tagged.tolist())) > 1
            ids = batch["input_ids"][row][batch["attention_mask"][row]]
            for v in set(tagged.tolist()):
                with torch.no_grad():
                    logits = weights[v](ids[None]).logits[0, :-1]
                logprobs = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
                at = (batch["versions"][row] == v) & mask
                expected = logprobs[at[1 : len(ids)]]
                torch.testing.assert_close(batch["logprobs"][row][at], expected,
                                           atol=1e-4, rtol=1e-4)
    assert mixed > 0, "an interrupted episode should carry tokens of two versions"
    assert stats["workflow_errors"] == 0 if "workflow_errors" in stats else True


def test_rollout_batch_evaluates_greedily_outside_training(tiny_model_dir, runner):
    engine = LocalEngine(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = RolloutConfig(batch_size=1, group_size=1, max_concurrent=8, max_staleness=0)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    try:
        scheduler = RolloutScheduler(pool=engine, workflow="rlvr", dataset=DATA,
                                     tokenizer=tokenizer, score=runner.score, config=config,
                                     sampling=SamplingParams(max_new_tokens=4))
        scheduler.pause()  # no training admissions: only the evaluation runs
        with scheduler:
            groups = scheduler.rollout_batch(DATA[:3], sampling=greedy)
            assert scheduler.stats()["accepted_total"] == 0
        for sample, group in zip(DATA[:3], groups):
            (episode,) = group
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": sample["question"]}],
                add_generation_prompt=True)["input_ids"]
            alone = asyncio.run(engine.generate(GenerationRequest(input_ids=prompt,
                                                                  sampling=greedy)))
            assert episode.token_ids == [*prompt, *alone.token_ids]
            assert episode.reward in (0.0, 1.0)
    finally:
        engine.close()
