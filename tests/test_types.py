"""Shared types validate what they are given and build episodes correctly."""

from __future__ import annotations

import pytest

from areal_flow.types import (
    Completion,
    DistributedWeights,
    Episode,
    GenerationRequest,
    LossOutput,
    SamplingParams,
    Segment,
    WeightUpdate,
)


def completion(tokens, version=0, temperature=1.0, finish="stop"):
    return Completion(
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        versions=[version] * len(tokens),
        finish_reason=finish,
        temperature=temperature,
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        SamplingParams(**kwargs)


def test_greedy_requests_report_logprobs_at_temperature_one():
    assert SamplingParams(temperature=0).logprob_temperature == 1.0
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.7).logprob_temperature == 0.7


def test_requests_and_completions_check_their_shapes():
    with pytest.raises(ValueError, match="at least one token"):
        GenerationRequest(input_ids=[])
    a, b = GenerationRequest(input_ids=[1, 2]), GenerationRequest(input_ids=[1, 2])
    assert a.rid != b.rid  # every request gets its own id for /abort_request
    with pytest.raises(ValueError, match="one logprob and one version per token"):
        Completion(token_ids=[1, 2], logprobs=[0.0], versions=[0, 0], finish_reason="stop")
    with pytest.raises(ValueError, match="'finish_reason' must be in"):
        completion([1], finish="done")
    # a segment a workflow builds by hand: a missing logprob would shift every later one
    # against its token in the collated batch
    for logprobs, versions in (([0.0], [0, 0]), ([0.0, 0.0], [0])):
        with pytest.raises(ValueError, match="a Segment needs one logprob and one version per "
                                             "token: 2 tokens"):
            Segment(token_ids=[1, 2], trainable=True, logprobs=logprobs, versions=versions)


def test_weight_update_carries_exactly_one_form():
    meta = DistributedWeights(names=["w"], dtypes=["float32"], shapes=[[2, 3]])
    assert WeightUpdate(version=1, dist_meta=meta).dist_meta.shapes == ((2, 3),)
    assert WeightUpdate(version=1, path="/ckpt").path == "/ckpt"
    with pytest.raises(ValueError, match="exactly one of"):
        WeightUpdate(version=1)
    with pytest.raises(ValueError, match="exactly one of"):
        WeightUpdate(version=1, path="/ckpt", dist_meta=meta)
    with pytest.raises(ValueError, match="same length"):
        DistributedWeights(names=["a", "b"], dtypes=["float32"], shapes=[[1]])


def test_episode_segments_keep_model_and_environment_tokens_apart():
    ep = Episode.start([1, 2, 3], completion([4, 5], version=2, temperature=0.7), reward=1.0)
    ep.add_tokens([6]).add(completion([7], version=3, temperature=0.7))
    assert ep.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert ep.loss_mask == [False, False, False, True, True, False, True]
    assert ep.versions == [-1, -1, -1, 2, 2, -1, 3]
    assert ep.logprobs == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, -0.5]
    assert (ep.num_tokens, ep.num_trainable_tokens, ep.temperature) == (7, 3, 0.7)


def test_an_episode_refuses_mixed_temperatures():
    ep = Episode.start([1], completion([2], temperature=0.7))
    with pytest.raises(ValueError, match="mixes logprob temperatures 0.7 and 1.0"):
        ep.add(completion([3], temperature=1.0))


def test_environment_tokens_cannot_carry_a_version():
    with pytest.raises(ValueError, match="version -1"):
        Segment(token_ids=[1], trainable=False, logprobs=[0.0], versions=[0])


def test_loss_output_names_its_unit():
    with pytest.raises(ValueError, match="'unit' must be in"):
        LossOutput(loss_sum=1.0, normalizer=1.0, unit="batches")


def test_an_algorithms_capabilities_are_what_it_declares_and_the_defaults_for_the_rest():
    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.types import AlgorithmCapabilities

    class Bare:
        roles = ()

    class Declares:
        roles = ()
        needs_entropy_grad = True
        min_group_size = 3

    assert AlgorithmCapabilities.of(Bare()) == AlgorithmCapabilities(
        needs_entropy_grad=False, skips_zero_advantage_rows=False, min_group_size=1)
    assert AlgorithmCapabilities.of(Declares()) == AlgorithmCapabilities(
        needs_entropy_grad=True, skips_zero_advantage_rows=False, min_group_size=3)
    grpo = AlgorithmCapabilities.of(GRPO(GRPOConfig(entropy_coef=0.01)))
    assert (grpo.needs_entropy_grad, grpo.min_group_size) == (True, 2)
