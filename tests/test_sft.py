"""SFT: assistant tokens found by incremental chat templating, the loss against a reference NLL,
and SFT lowering held-out NLL on the tiny model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow import algorithms
from areal_flow.algorithms.sft import SFT, SFTConfig
from areal_flow.config import OptimizerConfig
from areal_flow.data.sft import collate_sft, tokenize_conversation
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.types import MicroBatch, ModelOutput


def pieces(tokenizer, episode):
    """The decoded text of each run of trained / untrained tokens, in order."""
    runs, ids, mask = [], episode.token_ids, episode.loss_mask
    for token, trained in zip(ids, mask):
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return [(trained, tokenizer.decode(tokens)) for trained, tokens in runs]


words = st.text(alphabet="abcdefgh ?!.", min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(words, words), min_size=1, max_size=3), st.booleans())
def test_only_assistant_contents_and_their_end_of_turn_are_trained(tokenizer, turns, system):
    messages = [{"role": "system", "content": "be brief"}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant",
                                                          "content": assistant}]
    episode = tokenize_conversation(tokenizer, messages)
    trained = [text for is_trained, text in pieces(tokenizer, episode) if is_trained]
    assert trained == [f"{a}{tokenizer.eos_token}" for _, a in turns]
    # nothing is lost or added: the pieces make up the whole rendering
    assert tokenizer.decode(episode.token_ids) == tokenizer.apply_chat_template(
        messages, tokenize=False)


def test_a_conversation_without_an_assistant_turn_is_refused(tokenizer):
    with pytest.raises(ValueError, match="at least one assistant message"):
        tokenize_conversation(tokenizer, [{"role": "user", "content": "hi"}])


def test_the_loss_is_the_mean_nll_of_the_target_tokens():
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.4
    out = SFT().loss(ModelOutput(logprobs=logprobs), MicroBatch(loss_mask=mask))
    targets = [-logprobs[i, t].item() for i in range(3) for t in range(5) if mask[i, t]]
    assert out.loss_sum.item() / out.normalizer == pytest.approx(sum(targets) / len(targets))
    per_row = SFT(SFTConfig(aggregation="sequence")).loss(ModelOutput(logprobs=logprobs),
                                                          MicroBatch(loss_mask=mask))
    means = [sum(-logprobs[i, t].item() for t in range(5) if mask[i, t]) / int(mask[i].sum())
             for i in range(3) if mask[i].any()]
    assert per_row.loss_sum.item() / per_row.normalizer == pytest.approx(sum(means) / len(means))


def test_sft_is_registered_and_needs_no_forward_before_the_update():
    spec = algorithms.spec("sft")
    assert (spec.cls, spec.config) == (SFT, SFTConfig)
    assert SFT().roles == ()


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def conversation(i: int) -> list[dict[str, str]]:
    """A learnable mapping: the assistant answers with the user's word reversed, twice."""
    word = "".join("abcdefgh"[(i * 7 + k * 3) % 8] for k in range(3 + i % 3))
    return [{"role": "user", "content": word},
            {"role": "assistant", "content": f"{word[::-1]} {word[::-1]}"}]


def heldout_nll(trainer, batch) -> float:
    logprobs = trainer.forward(batch)["logprobs"]
    mask = batch["loss_mask"]
    return float(-(logprobs * mask).sum() / mask.sum())


def test_sft_lowers_heldout_nll(world, tiny_model_dir, tokenizer):
    train = collate_sft(tokenizer, [conversation(i) for i in range(40)])
    heldout = collate_sft(tokenizer, [conversation(i) for i in range(40, 50)])
    trainer = TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2)))
    before = heldout_nll(trainer, heldout)
    for _ in range(25):
        stats = trainer.train(train, SFT())
    after = heldout_nll(trainer, heldout)
    assert after < 0.7 * before, (before, after)
    assert stats["nll"] < before
