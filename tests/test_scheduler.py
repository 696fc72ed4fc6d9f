"""Scheduler behaviour around failures, long prompts and restarts, with an instant pool."""

from __future__ import annotations

import pytest

from areal_flow import workflow
from areal_flow.config import RolloutConfig
from areal_flow.registry import workflows as workflow_specs
from areal_flow.rollout.scheduler import RolloutError, RolloutScheduler
from areal_flow.types import Completion, SamplingParams
from areal_flow.workflow.context import field


class InstantPool:
    version = 0

    async def generate(self, request):
        return Completion(token_ids=[5, 6], logprobs=[-1.0, -1.0], versions=[self.version] * 2,
                          finish_reason="stop")


class NullTokenizer:
    pad_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return {"input_ids": [1] * len(messages[0]["content"])}


attempts: dict[int, int] = {}


@workflow("tests.flaky")
async def flaky(ctx, sample):
    """Fails `sample["fails"]` times before it succeeds."""
    attempts[sample["id"]] = attempts.get(sample["id"], 0) + 1
    if attempts[sample["id"]] <= sample["fails"]:
        raise RuntimeError(f"flaky {sample['id']}")
    prompt = ctx.chat([{"role": "user", "content": field(sample, "text")}])
    return ctx.episode(prompt, await ctx.generate(prompt), reward=1.0)


async def unused(*args, **kwargs):
    raise AssertionError


def scheduler(dataset, **config):
    return RolloutScheduler(
        pool=InstantPool(), workflow="tests.flaky", dataset=dataset, tokenizer=NullTokenizer(),
        score=unused, config=RolloutConfig(**{"max_concurrent": 8, "group_size": 2, **config}),
        sampling=SamplingParams(), shuffle=False)


def test_a_failing_workflow_is_retried_whole_and_counted():
    attempts.clear()
    data = [{"id": 0, "fails": 2, "text": "ab"}, {"id": 1, "fails": 0, "text": "abc"}]
    with scheduler(data, batch_size=2, group_size=1, max_retries=2, max_staleness=0) as s:
        batch = s.prepare_batch(timeout=30)
        stats = s.stats()
    assert sorted(set(batch["sample_ids"].tolist())) == [0, 1]
    assert stats["workflow_errors"] == 2 and "failed_samples" not in stats
    assert attempts[0] == 3  # two failures, then the retry that succeeded


def test_one_failing_episode_reruns_its_whole_group():
    attempts.clear()
    data = [{"id": 0, "fails": 1, "text": "ab"}]
    with scheduler(data, batch_size=1, group_size=3, max_retries=1, max_staleness=0) as s:
        batch = s.prepare_batch(timeout=30)
        stats = s.stats()
    assert batch["sample_ids"].tolist() == [0, 0, 0]  # a whole group, never a partial one
    assert stats["workflow_errors"] == 1 and attempts[0] >= 4


def test_samples_that_keep_failing_end_in_a_clear_error():
    attempts.clear()
    data = [{"id": i, "fails": 99, "text": "a"} for i in range(4)]
    with scheduler(data, batch_size=2, max_retries=1) as s:
        with pytest.raises(RolloutError, match=r"failed on 3 samples in a row; .* "
                                               r"RuntimeError\(.*\) \(attempt 2 of 2\)"):
            s.prepare_batch(timeout=30)


def test_a_missing_field_is_reported_once_with_the_rows_fields_and_not_retried():
    attempts.clear()
    data = [{"id": i, "fails": 0, "txt": "a"} for i in range(4)]
    with scheduler(data, batch_size=1, group_size=1, max_retries=2, max_concurrent=1) as s:
        with pytest.raises(RolloutError, match=r"no field 'text'.*the row's fields: id, fails, "
                                               r"txt; not retried"):
            s.prepare_batch(timeout=30)
    assert set(attempts.values()) == {1}  # a retry would fail the same way


@workflow("tests.rejects_everything")
async def rejects_everything(ctx, sample):
    return None


def test_a_workflow_returning_none_every_time_is_named_as_the_cause():
    s = scheduler([{"id": 0}], batch_size=1, group_size=2)
    s.workflow = workflow_specs.spec("tests.rejects_everything")
    with s, pytest.raises(RolloutError, match=r"workflow 'tests.rejects_everything' returned "
                                              r"None \(expected an Episode"):
        s.prepare_batch(timeout=60)


def test_long_prompts_are_skipped_and_counted():
    attempts.clear()
    data = [{"id": 0, "fails": 0, "text": "x" * 50}, {"id": 1, "fails": 0, "text": "short"}]
    with scheduler(data, batch_size=1, max_prompt_tokens=10, max_staleness=0) as s:
        batch = s.prepare_batch(timeout=30)
        stats = s.stats()
    assert batch["sample_ids"].tolist() == [1, 1]
    assert stats["skipped_long_prompts"] >= 1 and "workflow_errors" not in stats


class RecordingPool(InstantPool):
    """Instant completions; remembers each request's (sample id, seed) in arrival order."""

    def __init__(self):
        self.requests: list[tuple[int, int | None]] = []

    async def generate(self, request):
        self.requests.append((int(request.episode_id.split("/")[0]), request.sampling.seed))
        return await super().generate(request)


def seeds_by_sample(pool: RecordingPool) -> dict[int, list[int | None]]:
    out: dict[int, list[int | None]] = {}
    for sample_id, seed in pool.requests:
        out.setdefault(sample_id, []).append(seed)
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("order", ["fifo", "oldest_version"])
def test_a_restart_readmits_unconsumed_groups_first_in_admission_order_with_their_seeds(order):
    attempts.clear()
    data = [{"id": i, "fails": 0, "text": "ab"} for i in range(10)]

    def make(pool):
        s = scheduler(data, batch_size=2, max_staleness=1, consume_order=order)
        s.pool, s.shuffle, s.seed = pool, True, 7  # shuffled: admission order is not id order
        return s

    before = RecordingPool()
    with make(before) as s:
        first = s.prepare_batch(timeout=30)
        s.set_version(1)
        s.settle()
        state = s.state_dict()
    consumed = sorted(set(first["sample_ids"].tolist()))
    pending = [sample_id for _, sample_id in state["pending"]]
    admitted = list(dict.fromkeys(sample_id for sample_id, _ in before.requests))
    assert state["version"] == 1 and state["consumed"] == 2
    # η=1 at version 1 admits up to 3 batches' worth of groups: 2 consumed, 4 left unconsumed
    assert len(pending) == 4 and not set(pending) & set(consumed)
    assert pending == [i for i in admitted if i not in consumed] != sorted(pending)

    after = RecordingPool()
    restored = make(after)
    restored.load_state_dict(state)
    restored.pause()
    with restored:
        restored.resume()
        batches = [restored.prepare_batch(timeout=30) for _ in range(2)]
        stats = restored.stats()
    seen = [sorted(set(b["sample_ids"].tolist())) for b in batches]
    assert sorted(seen[0] + seen[1]) == sorted(pending)
    assert [i for i, _ in after.requests[::2][:4]] == pending  # re-admitted first, in order
    assert stats["version"] == 1 and stats["accepted_total"] <= (1 + 1 + 1) * 2
    # the re-admitted groups sample with the seeds they had before the restart
    seeds, again = seeds_by_sample(before), seeds_by_sample(after)
    assert {i: again[i] for i in pending} == {i: seeds[i] for i in pending}
    every_seed = [seed for _, seed in before.requests]
    assert None not in every_seed and len(set(every_seed)) == len(every_seed)


def test_an_unknown_consume_order_fails_naming_the_choices():
    with pytest.raises(ValueError, match="'consume_order' must be in .*'oldest_version'"):
        RolloutConfig(consume_order="lifo")
