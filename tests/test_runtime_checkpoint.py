"""Checkpoints and weight sync of the runtime, in a one-process world."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_flow.config import OptimizerConfig
from areal_flow.inference.local import LocalEngine
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.types import GenerationRequest, SamplingParams, WeightUpdate
from tests.dist_train_script import TokenNLL, fixed_batch


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def engine(model_dir):
    return TrainEngine(model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2),
                                              max_tokens_per_mb=200))


def test_hf_checkpoint_round_trip_gives_identical_logits(world, tiny_model_dir, tmp_path):
    trainer = engine(tiny_model_dir)
    batch = fixed_batch(trainer.model.config.vocab_size)
    trainer.train(batch, TokenNLL())
    trainer.save_hf(tmp_path / "hf", tokenizer_from=tiny_model_dir)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = batch["input_ids"][:2, :20]
    with torch.no_grad():
        expected = trainer.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert torch.equal(loaded(ids).logits, expected)
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_resume_gives_the_same_next_step_loss(world, tiny_model_dir, tmp_path):
    algorithm = TokenNLL()
    straight = engine(tiny_model_dir)
    batch = fixed_batch(straight.model.config.vocab_size)
    straight.train(batch, algorithm)
    straight.save_checkpoint(tmp_path / "ckpt", extra_state={"scheduler": {"position": 7}})
    expected = [straight.train(batch, algorithm)["loss"] for _ in range(2)]

    resumed = engine(tiny_model_dir)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"scheduler": {"position": 7}}
    assert resumed.steps == 1
    assert [resumed.train(batch, algorithm)["loss"] for _ in range(2)] == pytest.approx(
        expected, rel=1e-6)


def test_weight_sync_makes_the_local_engine_match_the_trainer(world, tiny_model_dir):
    trainer = engine(tiny_model_dir)
    batch = fixed_batch(trainer.model.config.vocab_size)
    trainer.train(batch, TokenNLL())
    pool = LocalEngine(tiny_model_dir)
    try:
        pool.update_weights(WeightUpdate(version=1, state_dict=trainer.full_state_dict()))
        prompt = batch["input_ids"][0, :6].tolist()
        out = asyncio.run(pool.generate(GenerationRequest(
            input_ids=prompt, sampling=SamplingParams(max_new_tokens=8, temperature=0.8,
                                                      ignore_eos=True, seed=0))))
    finally:
        pool.close()
    ids = torch.tensor([[*prompt, *out.token_ids]])
    rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "temperature": torch.tensor([0.8])}
    from tensordict import TensorDict

    mine = trainer.forward(TensorDict(rows, batch_size=[1]))["logprobs"][0, len(prompt):]
    torch.testing.assert_close(torch.tensor(out.logprobs), mine, atol=1e-4, rtol=1e-4)
    assert set(out.versions) == {1}
