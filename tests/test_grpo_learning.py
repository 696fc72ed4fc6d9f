"""GRPO learns a trivially learnable reward on the tiny model, synchronously and asynchronously:
local engine → scheduler → runtime → weight sync, the loop the GRPO recipe runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from areal_flow import algorithms, workflow
from areal_flow.algorithms.grpo import GRPO, GRPOConfig
from areal_flow.config import OptimizerConfig, RolloutConfig
from areal_flow.inference.local import LocalEngine
from areal_flow.rollout.scheduler import RolloutScheduler
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.types import SamplingParams, WeightUpdate

TARGET = set(range(10, 60))  # about an eighth of the tiny vocabulary


@workflow("tests.target_fraction")
async def target_fraction(ctx, sample):
    prompt = [1, 20 + sample["id"] % 7, 30, 2]
    out = await ctx.generate(prompt)
    hits = sum(t in TARGET for t in out.token_ids)
    return ctx.episode(prompt, out, reward=hits / len(out.token_ids))


async def unused(*args, **kwargs):
    raise AssertionError


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_grpo_is_registered_with_its_config():
    spec = algorithms.get("grpo")
    assert spec.cls is GRPO and spec.config is GRPOConfig


@pytest.mark.parametrize("eta", [0, 2])
def test_grpo_raises_a_learnable_reward(world, tiny_model_dir, eta):
    torch.manual_seed(0)
    engine = LocalEngine(tiny_model_dir, seed=0)
    trainer = TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2)))
    scheduler = RolloutScheduler(
        pool=engine, workflow="tests.target_fraction", dataset=[{"id": i} for i in range(50)],
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), score=unused,
        config=RolloutConfig(batch_size=4, group_size=4, max_staleness=eta, max_concurrent=64),
        sampling=SamplingParams(max_new_tokens=16, ignore_eos=True), seed=0)
    algorithm, rewards, lags, weights = GRPO(), [], set(), []
    try:
        with scheduler:
            for step in range(30):
                batch = scheduler.prepare_batch(timeout=60)
                rewards.append(batch["rewards"].mean().item())
                stats = trainer.train(batch, algorithm)
                weights.append(stats["importance_weight_max"])
                engine.update_weights(WeightUpdate(version=step + 1,
                                                   state_dict=trainer.full_state_dict()))
                scheduler.set_version(step + 1)
                lags |= {k for k, v in scheduler.stats().items() if k.startswith("staleness/")}
    finally:
        engine.close()
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 2 * first and last >= first + 0.2, rewards
    if eta == 0:
        assert lags == {"staleness/0"}
    else:  # off-policy tokens were trained on, through the behavior correction
        assert lags - {"staleness/0"} and max(weights) != 1.0
