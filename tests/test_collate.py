"""Collation of episode groups into the training batch, against a reference built from the raw
segments drawn in the test."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow.data.collate import collate_groups
from areal_flow.types import BATCH_KEYS, Completion, Episode

PAD = 0
tokens = st.lists(st.integers(1, 500), min_size=1, max_size=6)


@st.composite
def raw_episode(draw):
    """(prompt, [(trainable, ids, logprobs, versions, finish reason)], reward, temperature)"""
    temperature = draw(st.sampled_from([0.7, 1.0]))
    segments = []
    for trainable in draw(st.lists(st.booleans(), max_size=4)):
        ids = draw(tokens)
        if trainable:
            lps = [draw(st.floats(-20, 0)) for _ in ids]
            vers = [draw(st.integers(0, 5)) for _ in ids]
            reason = draw(st.sampled_from(["stop", "length"]))
        else:
            lps, vers, reason = None, None, None
        segments.append((trainable, ids, lps, vers, reason))
    return draw(tokens), segments, draw(st.floats(-1, 1)), temperature


def build(raw):
    prompt, segments, reward, temperature = raw
    ep = Episode.start(prompt, reward=reward)
    for trainable, ids, lps, vers, reason in segments:
        if trainable:
            ep.add(Completion(token_ids=ids, logprobs=lps, versions=vers,
                              finish_reason=reason, temperature=temperature))
        else:
            ep.add_tokens(ids)
    return ep


def reference_row(raw):
    prompt, segments, _, _ = raw
    ids, mask, lps, vers = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt)
    for trainable, seg_ids, seg_lps, seg_vers, _ in segments:
        ids += seg_ids
        mask += [int(trainable)] * len(seg_ids)
        lps += seg_lps if trainable else [0.0] * len(seg_ids)
        vers += seg_vers if trainable else [-1] * len(seg_ids)
    return ids, mask, lps, vers


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(raw_episode(), min_size=1, max_size=4), min_size=1, max_size=4))
def test_collation_matches_a_reference_built_from_the_segments(raw_groups):
    batch = collate_groups([[build(r) for r in g] for g in raw_groups], pad_token_id=PAD)
    flat = [(gid, r) for gid, g in enumerate(raw_groups) for r in g]
    assert set(BATCH_KEYS) <= set(batch.keys())
    width = max(len(reference_row(r)[0]) for _, r in flat)
    assert batch.batch_size == torch.Size([len(flat)])
    assert batch["input_ids"].shape == (len(flat), width)
    for i, (gid, raw) in enumerate(flat):
        ids, mask, lps, vers = reference_row(raw)
        pad = width - len(ids)
        assert batch["input_ids"][i].tolist() == ids + [PAD] * pad
        assert batch["attention_mask"][i].tolist() == [True] * len(ids) + [False] * pad
        assert batch["loss_mask"][i].tolist() == [bool(m) for m in mask] + [False] * pad
        assert batch["versions"][i].tolist() == vers + [-1] * pad
        torch.testing.assert_close(batch["logprobs"][i], torch.tensor(lps + [0.0] * pad))
        assert batch["group_ids"][i].item() == gid
        assert batch["rewards"][i].item() == torch.tensor(raw[2], dtype=torch.float32).item()
        has_model_tokens = any(t for t, *_ in raw[1])
        expected_t = raw[3] if has_model_tokens else 1.0
        assert batch["temperature"][i].item() == torch.tensor(expected_t).item()
        reasons = [reason for t, *_, reason in raw[1] if t]
        assert batch["truncated"][i].item() == (reasons[-1:] == ["length"])
    # rows of one group are adjacent: group ids never decrease
    assert torch.all(batch["group_ids"][1:] >= batch["group_ids"][:-1])


def test_collation_refuses_an_episode_without_reward():
    import pytest

    with pytest.raises(ValueError, match="has no reward"):
        collate_groups([[Episode.start([1, 2])]])
    with pytest.raises(ValueError, match="empty batch"):
        collate_groups([])


def test_samples_hold_every_segment_of_a_multi_turn_episode_in_order(tiny_model_dir):
    """samples.jsonl shows the environment's turns between the model's, marked untrained."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from areal_flow.rl_recipes import RLConfig, samples

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    turns = ["Question?", " first try", " Wrong, again.", " second try"]
    ids = [tok.encode(t, add_special_tokens=False) for t in turns]

    def said(token_ids):
        return Completion(token_ids=token_ids, logprobs=[-1.0] * len(token_ids),
                          versions=[0] * len(token_ids), finish_reason="stop")

    episode = Episode.start(ids[0], said(ids[1]), reward=0.5)
    episode.add_tokens(ids[2]).add(said(ids[3]))
    batch = collate_groups([[episode, Episode.start(ids[0], said(ids[1][:1]), reward=0.0)]])
    first = samples(RLConfig(samples_per_step=1), batch, SimpleNamespace(tokenizer=tok))
    assert len(first) == 1
    assert [(s["text"], s["trained"]) for s in first[0]["segments"]] == [
        (turns[0], False), (turns[1], True), (turns[2], False), (turns[3], True)]
    assert first[0]["prompt"] == turns[0] and first[0]["reward"] == 0.5
    assert first[0]["completion"] == turns[1] + turns[3]


def test_metrics_are_per_row_nan_where_missing_info_rides_along_and_padding_uses_the_pad_id():
    import math

    def said(ids):
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[3] * len(ids),
                          finish_reason="stop")

    first = Episode.start([1, 2], said([3, 4, 5]), reward=1.0)
    first.metrics, first.info = {"accuracy": 1.0, "steps": 2}, {"id": "first"}
    second = Episode.start([6], said([7]), reward=0.0)
    second.metrics, second.info = {"accuracy": 0.0}, {"id": "second", "note": [1]}
    third = Episode.start([8, 9], reward=0.5)  # prompt only: nothing reported
    batch = collate_groups([[first, second], [third]], pad_token_id=99)
    assert sorted(batch["metrics"].keys()) == ["accuracy", "steps"]
    assert batch["metrics"]["accuracy"].tolist()[:2] == [1.0, 0.0]
    assert math.isnan(batch["metrics"]["accuracy"][2])
    steps = batch["metrics"]["steps"].tolist()
    assert steps[0] == 2.0 and math.isnan(steps[1]) and math.isnan(steps[2])
    assert batch["metrics"].batch_size == torch.Size([3])
    assert list(batch["info"]) == [{"id": "first"}, {"id": "second", "note": [1]}, {}]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 99, 99, 99],
                                           [8, 9, 99, 99, 99]]
    assert batch["temperature"].tolist() == [1.0, 1.0, 1.0]
    assert batch["group_ids"].tolist() == [0, 0, 1]
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.5]
    # no episode reports a metric: an empty table of the batch's rows
    plain = collate_groups([[Episode.start([1], said([2]), reward=1.0)]])
    assert list(plain["metrics"].keys()) == [] and plain["metrics"].batch_size == torch.Size([1])


def test_every_key_keeps_its_dtype_for_integer_numbers_and_another_default_dtype():
    """Rewards and temperatures given as ints, a session whose default dtype is float64: the
    batch the trainer gets is the same (and padding is 0 unless told otherwise)."""
    said = Completion(token_ids=[3], logprobs=[-0.5], versions=[1], finish_reason="length",
                      temperature=1)
    episodes = [Episode.start([1, 2], said, reward=1), Episode.start([4], reward=0)]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        batch = collate_groups([episodes])
    finally:
        torch.set_default_dtype(previous)
    dtypes = {key: batch[key].dtype for key in (
        "input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards",
        "group_ids", "truncated", "temperature")}
    assert dtypes == {"input_ids": torch.long, "attention_mask": torch.bool,
                      "loss_mask": torch.bool, "logprobs": torch.float32, "versions": torch.long,
                      "rewards": torch.float32, "group_ids": torch.long, "truncated": torch.bool,
                      "temperature": torch.float32}
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["rewards"].tolist() == [1.0, 0.0] and batch["truncated"].tolist() == [True, False]
