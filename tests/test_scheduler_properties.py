"""The scheduler's staleness, concurrency and accounting guarantees, under a scripted pool whose
requests complete only when the test releases them, in a hypothesis-drawn order with version
bumps interleaved."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow import workflow
from areal_flow.config import RolloutConfig
from areal_flow.rollout.scheduler import RolloutError, RolloutScheduler, has_reward_variance
from areal_flow.types import Completion, SamplingParams

# a bug that hangs the scheduler leaves a test waiting without using CPU time (what mutmut
# limits): fail it in seconds, not in minutes
pytestmark = pytest.mark.timeout(15)

PROMPT = [1, 2, 3]


class ScriptedPool:
    """Each request waits until the test releases it. Its tokens get the version current at
    submission for the first half and the version current at release for the second, as an
    interrupted generation would."""

    def __init__(self):
        self.version = 0
        self.pending = []  # (submitted version, event, result slot)

    async def generate(self, request):
        event, slot = anyio.Event(), {}
        self.pending.append((self.version, event, slot))
        await event.wait()
        return slot["completion"]

    def release(self, index: int, length: int = 4) -> None:  # runs in the scheduler's loop
        submitted, event, slot = self.pending.pop(index % len(self.pending))
        versions = [submitted] * (length // 2) + [self.version] * (length - length // 2)
        slot["completion"] = Completion(token_ids=[7] * length, logprobs=[-1.0] * length,
                                        versions=versions, finish_reason="length")
        event.set()


class NullTokenizer:
    pad_token_id = 0


@workflow("tests.scripted")
async def scripted(ctx, sample):
    out = await ctx.generate(PROMPT)
    if sample["id"] % 5 == 4 and ctx.episode_id.endswith("/0"):
        return None  # every fifth prompt loses one episode
    episode_index = int(ctx.episode_id.rsplit("/", 1)[1])
    return ctx.episode(PROMPT, out, reward=float(sample["id"] % 3 + episode_index % 2))


async def no_reward(*args, **kwargs):
    raise AssertionError("not used")


actions = st.lists(
    st.one_of(st.tuples(st.just("release"), st.integers(0, 50)), st.tuples(st.just("train"))),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(
    batch_size=st.integers(1, 3),
    group_size=st.integers(1, 3),
    max_staleness=st.integers(0, 2),
    extra_concurrency=st.integers(0, 6),
    min_group_size=st.integers(1, 3),
    dynamic_sampling=st.booleans(),
    consume_order=st.sampled_from(["fifo", "oldest_version"]),
    steps=actions,
)
def test_staleness_concurrency_and_accounting_hold_in_any_order(
    batch_size, group_size, max_staleness, extra_concurrency, min_group_size,
    dynamic_sampling, consume_order, steps,
):
    config = RolloutConfig(batch_size=batch_size, group_size=group_size,
                           min_group_size=min(min_group_size, group_size),
                           max_concurrent=group_size + extra_concurrency,
                           max_staleness=max_staleness, max_prompt_tokens=16,
                           consume_order=consume_order)
    pool = ScriptedPool()
    scheduler = RolloutScheduler(
        pool=pool, workflow="tests.scripted", dataset=[{"id": i} for i in range(7)],
        tokenizer=NullTokenizer(), score=no_reward, config=config,
        sampling=SamplingParams(max_new_tokens=4),
        filters=[has_reward_variance] if dynamic_sampling and group_size > 1 else [], seed=1,
    )
    totals: dict[str, float] = {}

    def collect() -> dict[str, float]:
        stats = scheduler.stats()
        for key, value in stats.items():
            if not key.startswith(("version", "running", "queued", "accepted_total", "peak")):
                totals[key] = totals.get(key, 0) + value
        return stats

    consumed = 0
    with scheduler:
        scheduler.settle()
        for step in [*steps, ("drain",)]:
            if step[0] == "release" and pool.pending:
                scheduler.portal.call(pool.release, step[1])
            elif step[0] == "train":
                try:
                    batch = scheduler.prepare_batch(timeout=0)
                except TimeoutError:
                    pass
                else:
                    v = scheduler.version
                    trained = batch["versions"][batch["loss_mask"]]
                    assert int(trained.min()) >= v - max_staleness
                    if max_staleness == 0:
                        assert bool((trained == v).all())
                    assert len(set(batch["group_ids"].tolist())) == batch_size
                    consumed += batch_size
                    pool.version = v + 1
                    scheduler.set_version(v + 1)
            elif step[0] == "drain":  # admission must stop once the staleness limit is reached
                for _ in range(1000):
                    if not pool.pending:
                        break
                    scheduler.portal.call(pool.release, 0)
                    scheduler.settle()
                assert not pool.pending
            scheduler.settle()
            stats = collect()
            assert stats["peak_running_episodes"] <= config.max_concurrent
            # the admission rule holds at every quiet point
            assert (stats["accepted_total"] + stats["running_groups"]
                    <= (max_staleness + stats["version"] + 1) * batch_size)
            # every admitted group is running, queued, consumed or dropped for a counted reason
            assert totals.get("admitted_groups", 0) == (
                stats["running_groups"] + stats["queued_groups"] + consumed
                + totals.get("dropped_stale_groups", 0) + totals.get("dropped_small_groups", 0)
                + totals.get("dropped_filtered_groups", 0)
            )
            assert stats["accepted_total"] == consumed + stats["queued_groups"]
            assert stats["running_episodes"] == stats["running_groups"] * group_size
            assert len(pool.pending) <= stats["running_episodes"]


def test_a_prompt_is_admitted_only_when_its_whole_group_fits():
    config = RolloutConfig(batch_size=4, group_size=3, max_concurrent=5, max_staleness=4)
    pool = ScriptedPool()
    with RolloutScheduler(pool=pool, workflow="tests.scripted", dataset=[{"id": 0}],
                          tokenizer=NullTokenizer(), score=no_reward, config=config,
                          sampling=SamplingParams()) as scheduler:
        scheduler.settle()
        assert len(pool.pending) == 3  # a second group of 3 would exceed 5
        for _ in range(2):
            scheduler.portal.call(pool.release, 0)
        scheduler.settle()
        assert len(pool.pending) == 1  # two slots free, but a group needs three
        scheduler.portal.call(pool.release, 0)
        scheduler.settle()
        assert len(pool.pending) == 3


@pytest.mark.parametrize("eta", [0, 1])
def test_eta_bounds_how_far_rollout_runs_ahead_of_training(eta):
    config = RolloutConfig(batch_size=2, group_size=1, max_concurrent=64, max_staleness=eta)
    pool = ScriptedPool()
    whole = [{"id": i} for i in range(20) if i % 5 != 4]  # no group loses an episode
    with RolloutScheduler(pool=pool, workflow="tests.scripted",
                          dataset=whole, tokenizer=NullTokenizer(),
                          score=no_reward, config=config, sampling=SamplingParams()) as scheduler:
        scheduler.settle()
        assert len(pool.pending) == (eta + 1) * 2
        while pool.pending:
            scheduler.portal.call(pool.release, 0)
        scheduler.settle()
        assert len(pool.pending) == 0  # nothing more until the trainer moves on
        scheduler.prepare_batch(timeout=5)
        scheduler.set_version(1)
        scheduler.settle()
        assert len(pool.pending) == 2


def test_filters_that_reject_everything_end_in_a_clear_error():
    config = RolloutConfig(batch_size=1, group_size=1, max_concurrent=4, max_staleness=0)
    pool = ScriptedPool()
    with RolloutScheduler(pool=pool, workflow="tests.scripted",
                          dataset=[{"id": i} for i in range(3)], tokenizer=NullTokenizer(),
                          score=no_reward, config=config, sampling=SamplingParams(),
                          filters=[has_reward_variance]) as scheduler:
        for _ in range(1000):  # a group of one never has reward variance
            scheduler.settle()
            if not pool.pending:
                break
            scheduler.portal.call(pool.release, 0)
        with pytest.raises(RolloutError, match="groups were all dropped"):
            scheduler.prepare_batch(timeout=5)


STALE = "stale_dropped_token_fraction"


@pytest.mark.parametrize(("order", "trained_lengths", "periods"), [
    # FIFO trains the short group that finished second; the long one goes stale and is dropped
    ("fifo", [4, 4, 4], [{STALE: 0.0, f"{STALE}/len_0-15": 0.0},
                         {STALE: 0.0, f"{STALE}/len_0-15": 0.0},
                         {STALE: 60 / 64, f"{STALE}/len_0-15": 0.0, f"{STALE}/len_48+": 1.0}]),
    # oldest_version trains the long group while its oldest tokens are still allowed
    ("oldest_version", [4, 60, 4], [{STALE: 0.0, f"{STALE}/len_0-15": 0.0},
                                    {STALE: 0.0, f"{STALE}/len_48+": 0.0},
                                    {STALE: 0.0, f"{STALE}/len_0-15": 0.0}]),
])
def test_fifo_drops_long_generations_as_stale_and_oldest_version_trains_them(
    order, trained_lengths, periods,
):
    config = RolloutConfig(batch_size=1, group_size=1, max_concurrent=8, max_staleness=1,
                           consume_order=order)
    pool = ScriptedPool()
    scheduler = RolloutScheduler(
        pool=pool, workflow="tests.scripted", dataset=[{"id": i} for i in range(4)],
        tokenizer=NullTokenizer(), score=no_reward, config=config,
        sampling=SamplingParams(max_new_tokens=64), shuffle=False)  # length buckets of 16
    lengths, stats = [], []

    def finish(index: int, length: int) -> None:
        scheduler.portal.call(pool.release, index, length)
        scheduler.settle()

    def train() -> None:
        batch = scheduler.prepare_batch(timeout=5)
        lengths.append(int(batch["loss_mask"].sum()))
        stats.append({k: v for k, v in scheduler.stats().items() if k.startswith(STALE)})
        pool.version = scheduler.version + 1
        scheduler.set_version(pool.version)
        scheduler.settle()

    with scheduler:
        scheduler.settle()
        assert len(pool.pending) == 2  # η = 1: two groups admitted at version 0
        finish(1, 4)  # a short one finishes and is trained at version 0
        train()
        assert len(pool.pending) == 2  # the long one (version 0) and a new one (version 1)
        finish(1, 4)  # the short one finishes first ...
        finish(0, 60)  # ... then the long one, tokens of versions 0 and 1, both still allowed
        train()  # at version 1
        finish(0, 4)
        train()  # at version 2 a version-0 token is too stale
    assert lengths == trained_lengths
    assert stats == periods  # exact: 60 / 64 is a binary fraction


def test_dynamic_sampling_keeps_a_group_with_any_two_different_rewards():
    from areal_flow.types import Episode

    def group(*rewards):
        return [Episode(reward=r) for r in rewards]

    assert has_reward_variance(group(0.0, 1.0)) and has_reward_variance(group(1.0, 1.0, 0.5))
    assert not has_reward_variance(group(1.0, 1.0, 1.0)) and not has_reward_variance(group(0.0))


def test_a_stale_group_is_dropped_whole_and_every_counter_says_so():
    """Two groups of two episodes end in one period: the stale one is dropped, the fresh one
    trained. The dropped group leaves the accounting (accepted, pending on restart) and is
    counted; the stale-token fractions sum every episode, overall and per length bucket; the
    staleness histogram counts each trained token once by its lag."""
    config = RolloutConfig(batch_size=1, group_size=2, max_concurrent=4, max_staleness=1)
    pool = ScriptedPool()
    scheduler = RolloutScheduler(
        pool=pool, workflow="tests.scripted", dataset=[{"id": i} for i in range(4)],
        tokenizer=NullTokenizer(), score=no_reward, config=config,
        sampling=SamplingParams(max_new_tokens=64), shuffle=False)  # length buckets of 16

    def release(*lengths):
        for length in lengths:
            scheduler.portal.call(pool.release, 0, length)
        scheduler.settle()

    def new_version(v):
        pool.version = v
        scheduler.set_version(v)
        scheduler.settle()

    with scheduler:
        scheduler.settle()  # η = 1: rows 0 and 1 admitted at version 0
        release(4, 8)
        first = scheduler.prepare_batch(timeout=5)  # row 0, at version 0
        before = scheduler.stats()
        new_version(1)  # row 2 admitted
        release(20, 24)  # row 1: tokens of versions 0 and 1
        release(4, 20)  # row 2: version 1 only
        new_version(2)  # a version-0 token is now too stale: row 1 goes
        second = scheduler.prepare_batch(timeout=5)
        scheduler.settle()
        after = scheduler.stats()
        pending = [sample_id for _, sample_id in scheduler.state_dict()["pending"]]
    assert first["sample_ids"].tolist() == [0, 0] and second["sample_ids"].tolist() == [2, 2]
    assert before["staleness/0"] == 12 and "dropped_stale_groups" not in before
    assert after["dropped_stale_groups"] == 1 and after["staleness/1"] == 24
    assert "staleness/0" not in after and "staleness/2" not in after
    assert after["accepted_total"] == 2 + after["queued_groups"]  # rows 0 and 2, not row 1
    # to re-admit on a restart: the groups running now (rows 3 and 0 of the next epoch), not row 1
    assert pending == [3, 0] and after["running_groups"] == 2
    stale = "stale_dropped_token_fraction"
    assert after[stale] == pytest.approx(44 / 68)  # 20 + 24 dropped, 4 + 20 trained
    assert after[f"{stale}/len_0-15"] == 0.0
    assert after[f"{stale}/len_16-31"] == pytest.approx(44 / 64)


@workflow("tests.prompt_only")
async def prompt_only(ctx, sample):
    return ctx.episode(PROMPT, reward=float(sample["id"]))


@pytest.mark.parametrize("order", ["fifo", "oldest_version"])
def test_a_group_without_model_tokens_never_goes_stale(order):
    config = RolloutConfig(batch_size=1, group_size=2, max_concurrent=2, max_staleness=0,
                           consume_order=order)
    with RolloutScheduler(pool=ScriptedPool(), workflow="tests.prompt_only",
                          dataset=[{"id": 0}], tokenizer=NullTokenizer(), score=no_reward,
                          config=config, sampling=SamplingParams()) as scheduler:
        scheduler.settle()
        scheduler.set_version(5)
        batch = scheduler.prepare_batch(timeout=5)
        stats = scheduler.stats()
    assert batch["sample_ids"].tolist() == [0, 0] and "dropped_stale_groups" not in stats


def test_every_stale_drop_in_a_period_is_counted():
    config = RolloutConfig(batch_size=1, group_size=1, max_concurrent=1, max_staleness=0)
    pool = ScriptedPool()
    with RolloutScheduler(pool=pool, workflow="tests.scripted",
                          dataset=[{"id": i} for i in range(4)], tokenizer=NullTokenizer(),
                          score=no_reward, config=config, sampling=SamplingParams(),
                          shuffle=False) as scheduler:
        scheduler.settle()
        for v in (1, 2):  # a finished group goes stale, then one admitted after it is trained
            scheduler.settle()
            scheduler.portal.call(pool.release, 0)
            pool.version = v
            scheduler.set_version(v)
            scheduler.settle()
            scheduler.portal.call(pool.release, 0)
            scheduler.settle()
            scheduler.prepare_batch(timeout=5)
        stats = scheduler.stats()
    assert stats["dropped_stale_groups"] == 2
    assert stats["accepted_total"] == 2 + stats["queued_groups"]


@pytest.mark.parametrize("name", ["a/b", ""])
def test_an_episode_metric_name_must_be_a_plain_word(name):
    from areal_flow.rollout.scheduler import _check_metrics

    _check_metrics("w", {"accuracy": 1.0, "solved": True}, set())
    with pytest.raises(ValueError, match="plain word"):
        _check_metrics("w", {name: 1.0}, set())


def test_an_episode_metric_is_a_number_under_a_string_name():
    from areal_flow.rollout.scheduler import _check_metrics

    with pytest.raises(ValueError, match="plain word"):
        _check_metrics("w", {3: 1.0}, set())
    with pytest.raises(TypeError, match="a metric is a number"):
        _check_metrics("w", {"level": "high"}, set())
