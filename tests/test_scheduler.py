"""Scheduler behaviour around failures, long prompts and restarts, with an instant pool."""

from __future__ import annotations

import itertools
import pytest
import torch

from areal_flow import reward, workflow
from areal_flow.config import RolloutConfig
from areal_flow.registry import workflows as workflow_specs
from areal_flow.rollout.scheduler import RolloutError, RolloutScheduler
from areal_flow.types import Completion, RunEndingError, SamplingParams
from areal_flow.workflow.context import field

# a bug that hangs the scheduler leaves a test waiting without using CPU time (what mutmut
# limits): fail it in seconds, not in minutes
pytestmark = pytest.mark.timeout(15)


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


@workflow("tests.reward_over_its_limit")
async def reward_over_its_limit(ctx, sample):
    """Its reward has failed too often (what `RewardRunner.score` raises then)."""
    from areal_flow.reward.runner import RewardFailureError

    attempts[sample["id"]] = attempts.get(sample["id"], 0) + 1
    raise RewardFailureError(f"reward failed on 32 of its last 32 calls (sample {sample['id']})")


def test_a_run_ending_error_is_not_retried_and_stops_training_and_evaluation():
    """Not the row's fault and not passing: no retry, no workflow error, and the next batch
    (or the evaluation that met it) raises it as it is."""
    from areal_flow.reward.runner import RewardFailureError

    attempts.clear()
    data = [{"id": i, "fails": 0, "text": "a"} for i in range(4)]
    with RolloutScheduler(
            pool=InstantPool(), workflow="tests.reward_over_its_limit", dataset=data,
            tokenizer=NullTokenizer(), score=unused, sampling=SamplingParams(), shuffle=False,
            config=RolloutConfig(batch_size=2, group_size=1, max_retries=3,
                                 max_concurrent=1)) as s:
        with pytest.raises(RewardFailureError, match="failed on 32 of its last 32"):
            s.prepare_batch(timeout=30)
        stats = s.stats()
        with pytest.raises(RewardFailureError, match="failed on 32 of its last 32"):
            s.rollout_batch([{"id": 9, "text": "a"}])
    assert set(attempts.values()) == {1}  # never a second attempt
    assert "workflow_errors" not in stats


@workflow("tests.needs_a_missing_package")
async def needs_a_missing_package(ctx, sample):
    attempts[sample["id"]] = attempts.get(sample["id"], 0) + 1
    import not_an_installed_package_xyz  # noqa: F401


def test_a_workflow_needing_a_missing_package_ends_the_run_at_its_first_row_naming_it():
    attempts.clear()
    data = [{"id": i} for i in range(4)]
    with RolloutScheduler(
            pool=InstantPool(), workflow="tests.needs_a_missing_package", dataset=data,
            tokenizer=NullTokenizer(), score=unused, sampling=SamplingParams(), shuffle=False,
            config=RolloutConfig(batch_size=2, group_size=1, max_retries=3,
                                 max_concurrent=1)) as s:
        with pytest.raises(RunEndingError, match="workflow 'tests.needs_a_missing_package' "
                           "needs a package that is not installed: No module named "
                           "'not_an_installed_package_xyz'"):
            s.prepare_batch(timeout=30)
    assert attempts == {0: 1}  # no retry, no second row


def test_openai_client_without_openai_names_the_extra(monkeypatch):
    import sys

    from areal_flow.workflow.context import RolloutContext

    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` now fails
    ctx = RolloutContext(pool=InstantPool(), tokenizer=NullTokenizer(), score=unused,
                         sampling=SamplingParams(), episode_id="0/0/0")
    with pytest.raises(ModuleNotFoundError, match=r"ctx.openai_client\(\) needs the openai "
                       r"package: pip install 'areal-flow\[agents\]'"):
        ctx.openai_client()


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


class SlowPool(RecordingPool):
    """Completions after a short wait; remembers the most requests it held at once and each
    request's temperature."""

    def __init__(self):
        super().__init__()
        self.active = self.peak = 0
        self.temperatures: list[float] = []

    async def generate(self, request):
        import asyncio

        self.active += 1
        self.peak = max(self.peak, self.active)
        self.temperatures.append(request.sampling.temperature)
        try:
            await asyncio.sleep(0.002)
            return await super().generate(request)
        finally:
            self.active -= 1


def test_evaluation_runs_whole_groups_within_the_concurrency_limit_outside_the_training_counts():
    """`rollout_batch` gives each sample its group in order ([] for one that keeps failing),
    samples with the sampling given, runs at most max_concurrent episodes at once (whole
    groups), seeds each episode by its place reproducibly, and leaves the training counters and
    admission alone."""
    attempts.clear()
    data = [{"id": i, "fails": 0, "text": "a" * (i + 1)} for i in range(4)]
    data.append({"id": 4, "fails": 99, "text": "a"})
    # 3 slots: one group of 2 at a time, never a second (it does not fit whole)
    s = scheduler(data, batch_size=1, group_size=1, max_concurrent=3, max_retries=1)
    s.pool = pool = SlowPool()
    with pytest.raises(RuntimeError, match="start"):
        s.rollout_batch(data)
    s.pause()  # no training group is admitted
    with s:
        s.settle()
        out = s.rollout_batch(data, sampling=SamplingParams(temperature=0.5), group_size=2)
        stats = s.stats()
        first_seeds = seeds_by_sample(pool)
        pool.requests.clear()
        s.rollout_batch(data, sampling=SamplingParams(temperature=0.5), group_size=2)
        temperatures, second_seeds = set(pool.temperatures), seeds_by_sample(pool)
        single = s.rollout_batch(data[:2])  # one episode per sample by default
    assert [len(group) for group in single] == [1, 1]
    # labelled -1 - i: never a dataset row's id, and the sample recoverable
    assert [{ep.info["sample_id"] for ep in group} for group in out[:4]] == \
        [{-1 - i} for i in range(4)]
    assert [len(group) for group in out] == [2, 2, 2, 2, 0]
    assert [{len(ep.segments[0].token_ids) for ep in group} for group in out[:4]] == \
        [{i + 1} for i in range(4)]  # the prompt of sample i has i + 1 tokens
    assert pool.peak == 2 and temperatures == {0.5}
    assert second_seeds == first_seeds
    every = [seed for seeds in first_seeds.values() for seed in seeds]
    assert None not in every and len(set(every)) == len(every)
    assert not {"admitted_groups", "accepted_groups", "workflow_errors", "failed_samples",
                "rejected_episodes"} & set(stats)
    assert stats["accepted_total"] == 0 and stats["running_groups"] == 0


class Exploding(list):
    def __getitem__(self, index):
        raise ZeroDivisionError("a bug in the dataset")


def test_a_crash_of_the_scheduler_reaches_the_trainer_as_a_rollout_error():
    s = scheduler(Exploding([{"id": 0}]), batch_size=1, group_size=1)
    with s, pytest.raises(RolloutError, match="crashed.*ZeroDivisionError"):
        s.prepare_batch(timeout=5)


def test_a_paused_scheduler_admits_nothing_until_resumed():
    attempts.clear()
    s = scheduler([{"id": 0, "fails": 0, "text": "ab"}], batch_size=1, group_size=1)
    s.pool = pool = RecordingPool()
    s.pause()
    with s:
        s.settle()
        assert pool.requests == [] and s.stats()["running_groups"] == 0
        s.resume()
        batch = s.prepare_batch(timeout=5)
    assert batch["sample_ids"].tolist() == [0]


def test_a_restored_state_admits_next_what_the_uninterrupted_run_did():
    """Restored after two groups admitted and consumed (nothing pending), the scheduler admits
    the rows the uninterrupted run admitted third and fourth, with the same seeds."""
    attempts.clear()
    data = [{"id": i, "fails": 0, "text": "ab"} for i in range(6)]

    def run(pool, batches, state=None):
        s = scheduler(data, batch_size=1, max_staleness=0)
        s.pool, s.shuffle, s.seed = pool, True, 3
        if state is not None:
            s.load_state_dict(state)
        pool.version = s.version
        with s:
            for _ in range(batches):
                s.prepare_batch(timeout=5)
                pool.version = s.version + 1  # the weights the next group samples with
                s.set_version(pool.version)
            return s.state_dict()

    whole, restored = RecordingPool(), RecordingPool()
    assert run(whole, 4)["consumed"] == 4
    assert run(restored, 2, {"position": 2, "version": 2, "consumed": 2, "admitted": 2,
                             "pending": []})["consumed"] == 4
    assert restored.requests[:4] == whole.requests[4:8]  # 2 episodes per group
    assert len({i for i, _ in whole.requests[:8]}) == 4  # four different rows


def test_groups_a_filter_rejects_are_counted_and_replaced():
    attempts.clear()
    data = [{"id": i, "fails": 0, "text": "ab"} for i in range(4)]
    s = scheduler(data, batch_size=2, group_size=1, max_staleness=0)
    s.filters = (lambda group: group[0].info["sample_id"] != 0,)
    with s:
        batch = s.prepare_batch()  # no timeout: waits as long as it takes
        s.settle()
        stats, pending = s.stats(), s.state_dict()["pending"]
    assert batch["sample_ids"].tolist() == [1, 2]
    assert pending == []  # the rejected group is not re-admitted on a restart
    assert stats["dropped_filtered_groups"] == 1 and stats["accepted_groups"] == 2
    assert "dropped_small_groups" not in stats


@pytest.mark.parametrize(("batch_size", "limit"), [(1, 200), (5, 250)])
def test_rollout_gives_up_after_the_larger_of_200_and_50_batches_of_dropped_groups(batch_size,
                                                                                 limit):
    attempts.clear()
    s = scheduler([{"id": i, "fails": 0, "text": "ab"} for i in range(3)],
                  batch_size=batch_size, group_size=1, max_concurrent=1)
    s.filters = (lambda group: False,)
    with s:
        with pytest.raises(RolloutError, match=f"the last {limit} groups were all dropped"):
            s.prepare_batch(timeout=10)
        s.settle()
        stats = s.stats()
    assert stats["dropped_filtered_groups"] == limit  # and not one more was admitted


def test_an_accepted_group_resets_the_count_of_failures_in_a_row():
    """Two failing samples, an accepted one, two more failing: never three in a row."""
    attempts.clear()
    fails = [99, 99, 0, 99, 99, 0]
    data = [{"id": i, "fails": f, "text": "ab"} for i, f in enumerate(fails)]
    with scheduler(data, batch_size=1, group_size=1, max_concurrent=1, max_retries=0,
                   max_staleness=5) as s:
        batches = [s.prepare_batch(timeout=5) for _ in range(2)]
        stats = s.stats()
    assert [b["sample_ids"].tolist() for b in batches] == [[2], [5]]
    assert stats["failed_samples"] >= 4  # and admission went on after each


class DelayedPool(InstantPool):
    """Answers after `delay` seconds (None: never)."""

    def __init__(self, delay: float | None):
        self.delay = delay

    async def generate(self, request):
        import anyio

        await (anyio.sleep(self.delay) if self.delay is not None else anyio.Event().wait())
        return await super().generate(request)


def test_prepare_batch_waits_for_groups_as_long_as_its_timeout_allows():
    import areal_flow.data.collate  # noqa: F401 - imported at the first batch, in seconds

    attempts.clear()
    data = [{"id": i, "fails": 0, "text": "ab"} for i in range(4)]
    s = scheduler(data, batch_size=1, group_size=1, max_staleness=0)
    s.pool = DelayedPool(0.2)
    with s:
        assert s.prepare_batch()["sample_ids"].tolist() == [0]  # no timeout: waits as needed
        s.pool.version = 1
        s.set_version(1)
        # a second of patience is enough for a group 0.2 s away
        assert s.prepare_batch(timeout=1.0)["sample_ids"].tolist() == [1]
    s = scheduler(data, batch_size=1, group_size=1)
    s.pool = DelayedPool(None)  # never answers: the timeout ends the wait (not the test's)
    with s, pytest.raises(TimeoutError, match="fewer than 1 groups ready after 0.3 s"):
        s.prepare_batch(timeout=0.3)


def test_every_row_of_a_batch_names_the_version_it_is_trained_at():
    attempts.clear()
    data = [{"id": i, "fails": 0, "text": "ab"} for i in range(6)]
    with scheduler(data, batch_size=1, group_size=2, max_staleness=1) as s:
        s.prepare_batch(timeout=30)
        s.set_version(1)
        batch = s.prepare_batch(timeout=30)
    assert batch["policy_version"].tolist() == [1, 1]
    assert batch["policy_version"].dtype == batch["versions"].dtype == torch.long


seen: list[tuple[str, int]] = []


@workflow("tests.recorded")
async def recorded(ctx, sample):
    """Records (episode id, seed); fails the first attempt at `sample["fails"]` episodes;
    rejects (returns None for) episode `sample["reject"]` of each group."""
    seen.append((ctx.episode_id, ctx.seed))
    _, attempt, i = ctx.episode_id.split("/")
    if int(attempt) < sample.get("fails", 0):
        raise RuntimeError("flaky")
    if int(i) == sample.get("reject", -1):
        return None
    prompt = ctx.chat([{"role": "user", "content": "ab"}])
    return ctx.episode(prompt, await ctx.generate(prompt), reward=1.0)


def recording_scheduler(dataset, **config):
    return RolloutScheduler(
        pool=InstantPool(), workflow="tests.recorded", dataset=dataset,
        tokenizer=NullTokenizer(), score=unused,
        config=RolloutConfig(**{"max_concurrent": 8, **config}), sampling=SamplingParams(),
        shuffle=False)


def test_a_retried_group_draws_new_seeds_and_evaluation_draws_its_own():
    seen.clear()
    with recording_scheduler([{"fails": 1}], batch_size=1, group_size=2, max_retries=1,
                             max_staleness=0) as s:
        s.prepare_batch(timeout=30)
        train = dict(seen)
        assert s.stats()["workflow_errors"] == 1  # the first attempt, retried whole
        s.rollout_batch([{"fails": 0}], group_size=2)
    assert sorted(train) == ["0/0/0", "0/0/1", "0/1/0", "0/1/1"]
    assert len(set(train.values())) == 4  # a retry does not replay the failed attempt's draws
    evaluation = [seed for episode, seed in seen[4:]]
    assert len(evaluation) == 2 and not set(evaluation) & set(train.values())


def test_rejected_episodes_and_failed_samples_are_counted_exactly():
    seen.clear()
    data = [{"reject": 1}, {"fails": 9}, {"reject": 0}, {}]
    with recording_scheduler(data, batch_size=3, group_size=3, max_retries=1,
                             max_staleness=0) as s:
        batch = s.prepare_batch(timeout=30)
        s.settle()
        stats = s.stats()
    assert sorted(batch["sample_ids"].tolist()) == [0, 0, 2, 2, 3, 3, 3]
    assert stats["rejected_episodes"] == 2 and stats["failed_samples"] == 1


def test_each_epoch_admits_every_sample_once():
    seen.clear()
    for shuffle in (False, True):
        s = recording_scheduler([{} for _ in range(5)], batch_size=1, group_size=1,
                                max_staleness=20)
        s.shuffle, s.seed = shuffle, 3
        with s:
            ids = [s.prepare_batch(timeout=30)["sample_ids"].item() for _ in range(10)]
        assert sorted(ids[:5]) == sorted(ids[5:]) == [0, 1, 2, 3, 4]
        assert (ids[:5] == [0, 1, 2, 3, 4]) != shuffle


@reward("tests.scheduler_length")
def length_reward(text: str) -> float:
    return float(len(text))


@workflow("tests.scored_agent")
async def scored_agent(ctx, sample):
    """Scores through the scheduler's reward path, reads its options, and opens the OpenAI
    endpoint an agent in another process would call."""
    access = await ctx.openai_server()
    seen.append((access.base_url, ctx.seed))
    prompt = ctx.chat([{"role": "user", "content": "ab"}])
    score = await ctx.reward("tests.scheduler_length", "abc")
    return ctx.episode(prompt, await ctx.generate(prompt), reward=score + ctx.config["bonus"])


def test_a_workflow_scores_reads_its_options_and_shares_one_endpoint_per_scheduler():
    seen.clear()
    scored = []

    async def stand_in(reward_name, *args, **kwargs):  # a RewardRunner.score in process
        scored.append((reward_name, args))
        return 7.0

    s = RolloutScheduler(
        pool=InstantPool(), workflow="tests.scored_agent", dataset=[{}, {}], score=stand_in,
        tokenizer=NullTokenizer(), workflow_config={"bonus": 1.5}, sampling=SamplingParams(),
        config=RolloutConfig(max_concurrent=8, batch_size=2, group_size=2, max_staleness=0),
        shuffle=False)
    with s:
        batch = s.prepare_batch(timeout=30)
    assert batch["rewards"].tolist() == [8.5] * 4
    assert scored == [("tests.scheduler_length", ("abc",))] * 4
    assert len({url for url, _ in seen}) == 1  # one server for every episode, not one each


def test_by_default_the_data_is_shuffled_and_nothing_has_run():
    data = [{"id": i, "fails": 0, "text": "ab"} for i in range(20)]
    s = RolloutScheduler(pool=InstantPool(), workflow="tests.flaky", dataset=data,
                         tokenizer=NullTokenizer(), score=unused,
                         config=RolloutConfig(batch_size=1, group_size=1, max_staleness=20),
                         sampling=SamplingParams())
    assert s.stats()["peak_running_episodes"] == 0
    with s:
        ids = [s.prepare_batch(timeout=30)["sample_ids"].item() for _ in range(20)]
    assert sorted(ids) == list(range(20)) and ids != list(range(20))


def test_a_stopped_scheduler_starts_again_and_stops_at_once_after_starting():
    data = [{"id": 0, "fails": 0, "text": "ab"}]
    s = scheduler(data, batch_size=1, group_size=1)
    s.start()
    s.stop()  # before the admission task could run
    with s:
        assert s.prepare_batch(timeout=30)["sample_ids"].tolist() == [0]


def test_the_openai_endpoint_reports_the_tokenizers_model_name():
    class Named(NullTokenizer):
        name_or_path = "org/some-model"

    assert scheduler([{}]).openai_endpoint().model == "policy"  # a tokenizer without a name
    named = RolloutScheduler(pool=InstantPool(), workflow="tests.flaky", dataset=[{}],
                             tokenizer=Named(), score=unused, config=RolloutConfig(),
                             sampling=SamplingParams())
    assert named.openai_endpoint().model == "org/some-model"


def test_the_runs_seed_changes_every_episodes_seed():
    seeds = {}
    for run_seed in (1, 2):
        seen.clear()
        s = recording_scheduler([{}], batch_size=1, group_size=2, max_staleness=0)
        s.seed = run_seed
        with s:
            s.prepare_batch(timeout=30)
        seeds[run_seed] = {seed for _, seed in seen}
    assert len(seeds[1]) == len(seeds[2]) == 2 and not seeds[1] & seeds[2]


def test_a_workflow_spec_object_is_taken_as_it_is():
    spec = workflow_specs.spec("tests.flaky")
    s = RolloutScheduler(pool=InstantPool(), workflow=spec, dataset=[{"id": 0, "fails": 0,
                                                                       "text": "ab"}],
                         tokenizer=NullTokenizer(), score=unused, sampling=SamplingParams(),
                         config=RolloutConfig(batch_size=1, group_size=1))
    assert s.workflow is spec


@workflow("tests.flat_or_not")
async def flat_or_not(ctx, sample):
    """A `flat` row rewards every episode 1 (no signal); another rewards its episodes 1, 0."""
    prompt = ctx.chat([{"role": "user", "content": "ab"}])
    episode = ctx.episode(prompt, await ctx.generate(prompt))
    episode.reward = 1.0 if sample["flat"] else float(ctx.episode_id.endswith("/0"))
    return episode


def flat_scheduler(dataset, **config):
    return RolloutScheduler(
        pool=InstantPool(), workflow="tests.flat_or_not", dataset=dataset,
        tokenizer=NullTokenizer(), score=unused, sampling=SamplingParams(), shuffle=False,
        config=RolloutConfig(**{"max_concurrent": 8, "group_size": 2, "batch_size": 2,
                                "max_staleness": 0, **config}))


def group_rewards(batch) -> list[list[float]]:
    rows = zip(batch["group_ids"].tolist(), batch["rewards"].tolist())
    return [[r for _, r in group] for _, group in itertools.groupby(rows, key=lambda p: p[0])]


def test_dynamic_sampling_trains_no_flat_group_and_counts_what_it_dropped():
    data = [{"flat": i % 3 != 0} for i in range(12)]  # rows 0, 3, 6, 9 have signal
    with flat_scheduler(data, filter_flat_groups=100) as s:
        batches = [s.prepare_batch(timeout=10)]
        s.pool.version = 1  # the weights the next groups are generated with
        s.set_version(1)
        batches.append(s.prepare_batch(timeout=10))
        s.settle()  # nothing more is admitted before the next version
        stats = s.stats()
    assert [group_rewards(b) for b in batches] == [[[1.0, 0.0]] * 2] * 2
    assert [b["sample_ids"].tolist() for b in batches] == [[0, 0, 3, 3], [6, 6, 9, 9]]
    # rows 1, 2, 4, 5, 7, 8 were drawn and dropped, 2 episodes of 2 tokens each
    assert (stats["dropped_flat_groups"], stats["dropped_flat_tokens"]) == (6, 6 * 2 * 2)
    assert stats["accepted_groups"] == 4


def test_dynamic_sampling_drops_at_most_its_bound_per_batch_then_keeps_flat_groups():
    data = [{"flat": True} for _ in range(40)]
    with flat_scheduler(data, filter_flat_groups=3) as s:
        for version in range(1, 4):
            batch = s.prepare_batch(timeout=10)  # comes although every group is flat
            s.settle()
            stats = s.stats()
            assert stats["dropped_flat_groups"] == 3, version  # the bound, again each batch
            assert stats["batch_dropped_flat_groups"] == 3, version
            assert group_rewards(batch) == [[1.0, 1.0]] * 2
            s.pool.version = version
            s.set_version(version)


def test_dynamic_sampling_needs_groups_of_two():
    with pytest.raises(ValueError, match="'filter_flat_groups' needs group_size >= 2: a group "
                                         "of 1 is always flat"):
        RolloutConfig(group_size=1, filter_flat_groups=4)
