"""`RewardModel` / `ctx.reward_model`: a tiny sequence classifier built from the tiny model's
config scores concurrent calls in one padded batch, each equal to a forward pass on that text
alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_flow.judges.reward_model import RewardModel, load
from areal_flow.types import SamplingParams
from areal_flow.workflow.context import RolloutContext

CHATS = [
    [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "What is 2 plus 3?"},
     {"role": "assistant", "content": "It is 2 + 3 = 5, so the answer is 5."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "blue"}],
]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():  # a score head far from zero, so texts get distinct scores
        model.score.weight.normal_(0.0, 1.0)
    path = tmp_path_factory.mktemp("reward_model")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def direct(path, text: str) -> float:
    """One unpadded forward pass of the saved model on `text`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def test_concurrent_calls_share_one_batch_and_match_a_direct_forward(rm_dir, tokenizer):
    rm = RewardModel(rm_dir)
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in CHATS]
    assert len({len(tokenizer.encode(t)) for t in texts}) == 3  # padding is exercised

    async def score_all():
        return await asyncio.gather(*(rm.score(c) for c in CHATS))

    scores = asyncio.run(score_all())
    assert rm.forward_calls == 1
    expected = [direct(rm_dir, t) for t in texts]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert len({round(s, 4) for s in scores}) == 3  # not one number for every text
    assert asyncio.run(rm.score(texts[1])) == pytest.approx(expected[1], abs=1e-4)  # a text


def test_batches_are_capped_at_max_batch_size(rm_dir):
    rm = RewardModel(rm_dir, max_batch_size=2)

    async def score_all():
        return await asyncio.gather(*(rm.score(c) for c in CHATS))

    scores = asyncio.run(score_all())
    assert rm.forward_calls == 2 and len(scores) == 3


def test_ctx_reward_model_loads_once_per_path(rm_dir, tokenizer):
    async def no_reward(*args, **kw):
        raise AssertionError

    ctx = RolloutContext(pool=None, tokenizer=tokenizer, score=no_reward,
                         sampling=SamplingParams(), episode_id="0/0/0")
    score = asyncio.run(ctx.reward_model(CHATS[0], model=str(rm_dir)))
    assert score == pytest.approx(
        direct(rm_dir, tokenizer.apply_chat_template(CHATS[0], tokenize=False)), abs=1e-4)
    assert load(str(rm_dir)) is load(str(rm_dir))


def test_a_model_with_more_than_one_output_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    LlamaForSequenceClassification(AutoConfig.from_pretrained(
        tiny_model_dir, num_labels=2)).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel(tmp_path)
