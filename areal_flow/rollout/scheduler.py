"""The rollout scheduler: admits prompts under the staleness and concurrency limits, runs G
workflow episodes per prompt, keeps whole groups, and hands the trainer collated batches. It runs
an anyio event loop in a thread it owns; the trainer thread's calls are thread-safe. Admission
(B = prompts per step, G = group size, η = max_staleness, counting groups):
    running_episodes + G <= max_concurrent   and   (η + version + 1)·B > accepted + running
where `accepted` counts groups accepted and not dropped (consumed included). At consumption a
group holding a token older than version − η is dropped (generations can outlive admission).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.from_thread
import attrs

from areal_flow.config import RolloutConfig
from areal_flow.registry import workflows
from areal_flow.types import (Episode, GenerationPool, RunEndingError, SamplingParams,
                              WorkflowSpec, derived_seed)
from areal_flow.workflow.context import PromptTooLong, RolloutContext

log = logging.getLogger(__name__)

GroupFilter = Callable[[list[Episode]], bool]
"""``should_accept(group)``: False drops the whole group and frees its capacity."""


class RolloutError(RuntimeError):
    """Rollout cannot produce batches (every sample keeps failing, or the scheduler crashed)."""


async def _all_tasks_blocked() -> None:
    # anyio.wait_all_tasks_blocked does the same check but naps 0.1 s between tries, which makes
    # stepping a scheduler thousands of times in a property test take minutes.
    import asyncio

    me = asyncio.current_task()
    while True:
        await asyncio.sleep(0)
        if all(t is me or (t._fut_waiter is not None and not t._fut_waiter.done())
               for t in asyncio.all_tasks()):
            return


async def _run_all(fn: Callable[[int], Any], n: int) -> None:
    """``fn(0)`` ... ``fn(n - 1)`` concurrently; the first error cancels the rest and is raised."""
    try:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(fn, i)
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None


def has_reward_variance(group: list[Episode]) -> bool:
    """DAPO dynamic sampling: a group whose rewards are all equal has zero advantage everywhere."""
    return len({ep.reward for ep in group}) > 1


@attrs.define
class _Group:
    serial: int
    """Its admission number: the seeds of its episodes derive from it (`_episodes`)."""
    sample_id: int
    episodes: list[Episode]

    def oldest_version(self) -> float:
        """The oldest model token's version; inf without model tokens (it never goes stale)."""
        return min((v for ep in self.episodes for v in ep.versions if v >= 0), default=math.inf)


_SAME_AGAIN = (LookupError, TypeError, AttributeError)
"""Errors from the row or the code (not a server or a timeout), which a retry would raise again."""


class RolloutScheduler:
    """Runs a workflow (``async fn(ctx, sample) -> Episode | None``) over `dataset`'s rows (by
    index) against `pool`; `workflow_config` is `ctx.config`; every filter must accept a group."""

    def __init__(self, *, pool: GenerationPool, workflow: str | WorkflowSpec,
                 dataset: Sequence[dict[str, Any]], tokenizer: Any, score: Callable[..., Any],
                 config: RolloutConfig, sampling: SamplingParams, workflow_config: Any = None,
                 filters: Sequence[GroupFilter] = (), shuffle: bool = True, seed: int = 0):
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        self.pool = pool
        self.workflow = workflows.spec(workflow) if isinstance(workflow, str) else workflow
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.config = config
        self.sampling = sampling
        self.workflow_config = workflow_config
        self.filters = tuple(filters)
        self.shuffle, self.seed = shuffle, seed
        self._score = score
        self._permutations: dict[int, list[int]] = {}

        self._cond = threading.Condition()  # guards everything below that both threads touch
        self._queue: deque[_Group] = deque()
        self._version = 0
        self._accepted = 0
        self._position = 0
        self._admitted = 0  # the next admission's number
        self._pending: deque[tuple[int, int]] = deque()  # (admission number, sample id)
        self._inflight: dict[int, int] = {}  # admitted, not yet consumed or lost: number -> id
        self._running_groups = 0
        self._running_episodes = 0
        self._paused = False
        self._fatal: Exception | None = None
        self._consecutive_failures = 0
        self._consecutive_drops = 0
        self._consecutive_empty = 0  # of those drops, groups whose every episode was None
        self._counts: Counter[str] = Counter()
        self._flat_dropped = 0  # flat groups dropped since the last batch (filter_flat_groups)
        self._flat_dropped_for_batch = 0  # ... and for the last batch, at its consumption
        self._peak_running = 0
        # model tokens that left the queue, by (dropped as stale?, "" or a length bucket)
        self._tokens: Counter[tuple[bool, str]] = Counter()
        # length buckets: quarters of max_new_tokens, the last open (multi-turn episodes exceed it)
        self._len_width = w = -(-sampling.max_new_tokens // 4)
        self._len_keys = [*(f"/len_{i * w}-{(i + 1) * w - 1}" for i in range(3)), f"/len_{3 * w}+"]

        self._portal_cm = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        # workflows' OpenAI-compatible endpoint (an agents' part): one app, a key per episode,
        # served on this loop, made when a first episode asks for it
        self._openai_endpoint = None
        self._changed: anyio.Event | None = None
        self._cancel: anyio.CancelScope | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> RolloutScheduler:
        if self._portal is not None:
            raise RuntimeError("the scheduler is already started")
        self._portal_cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
        self._portal = self._portal_cm.__enter__()
        # made before the task starts: a stop() before it runs must still cancel it (a
        # scope cancelled before it is entered cancels on entry), or the portal waits forever
        self._cancel = self._portal.call(anyio.CancelScope)
        self._portal.start_task_soon(self._admit_forever, name="rollout-admission")
        return self

    def stop(self) -> None:
        if self._portal is None:
            return
        self._portal.call(self._cancel.cancel)
        if self._openai_endpoint is not None:
            self._portal.call(self._openai_endpoint.close)
        self._portal_cm.__exit__(None, None, None)
        self._portal = self._portal_cm = None

    def __enter__(self) -> RolloutScheduler:
        return self.start()

    def openai_endpoint(self) -> Any:
        """The workflows' OpenAI-compatible endpoint, made (and its module loaded) on first use."""
        if self._openai_endpoint is None:
            from areal_flow.agents.openai_endpoint import OpenAIEndpoint

            self._openai_endpoint = OpenAIEndpoint(
                model=getattr(self.tokenizer, "name_or_path", "") or "policy")
        return self._openai_endpoint

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- trainer-thread API -------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def portal(self) -> anyio.from_thread.BlockingPortal:
        """The blocking portal of the scheduler's loop, to run code in it from another thread."""
        if self._portal is None:
            raise RuntimeError("start() the scheduler first")
        return self._portal

    def settle(self) -> None:
        """Return once every task in the loop is waiting (tests step the scheduler with it)."""
        self.portal.call(_all_tasks_blocked)

    def set_version(self, version: int) -> None:
        """The trainer's weights are now `version` (call after the pool's weight update)."""
        with self._cond:
            self._version = version
            self._cond.notify_all()
        self._wake()

    def pause(self) -> None:
        """Admit no new prompts; episodes in flight continue."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake()

    def prepare_batch(self, batch_size: int | None = None, timeout: float | None = None):
        """Block for `batch_size` (default B) fresh groups: collated, with `policy_version`."""
        from areal_flow.data.collate import collate_groups

        size = batch_size or self.config.batch_size
        dropped = 0

        def ready() -> bool:
            nonlocal dropped
            dropped += self._drop_stale_locked()
            return self._fatal is not None or len(self._queue) >= size

        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                raise TimeoutError(f"fewer than {size} groups ready after {timeout} s")
            if self._fatal is not None:
                raise self._fatal
            order = list(self._queue)  # "fifo": in finishing order
            if self.config.consume_order == "oldest_version":
                order.sort(key=_Group.oldest_version)  # stable: ties keep finishing order
            groups, self._queue = order[:size], deque(order[size:])
            # rows in admission order: the batch does not depend on which finished first
            groups.sort(key=lambda g: g.serial)
            self._retire_locked(groups, stale=False)
            self._flat_dropped_for_batch = self._flat_dropped
            self._flat_dropped = 0  # the next batch may drop as many again
            version = self._version
        if dropped:
            self._wake()
        batch = collate_groups([g.episodes for g in groups],
                               pad_token_id=self.tokenizer.pad_token_id or 0)
        import torch

        batch["sample_ids"] = torch.tensor(
            [g.sample_id for g in groups for _ in g.episodes], dtype=torch.long)
        batch["policy_version"] = torch.full((batch.batch_size[0],), version, dtype=torch.long)
        lags = (version - batch["versions"][batch["loss_mask"]]).tolist()
        with self._cond:
            self._counts.update(f"staleness/{lag}" for lag in lags)
        return batch

    def rollout_batch(self, samples: Sequence[dict[str, Any]], *,
                      sampling: SamplingParams | None = None,
                      group_size: int = 1) -> list[list[Episode]]:
        """Run `samples` now (evaluation), outside admission; one that keeps failing gives []."""
        return self.portal.call(self._rollout_now, list(samples), sampling or self.sampling,
                                group_size)

    def stats(self) -> dict[str, float]:
        """Counters since the last call, and current gauges."""
        with self._cond:
            counts, self._counts = self._counts, Counter()
            tokens, self._tokens = self._tokens, Counter()
            peak, self._peak_running = self._peak_running, self._running_episodes
            gauges = {
                "version": self._version,
                "running_episodes": self._running_episodes,
                "running_groups": self._running_groups,
                "queued_groups": len(self._queue),
                "accepted_total": self._accepted,
                "peak_running_episodes": peak,
                # at most filter_flat_groups; `dropped_flat_groups` counts since the last call,
                # which at η >= 1 also holds drops towards the next batch
                "batch_dropped_flat_groups": self._flat_dropped_for_batch,
            }
        # Of the model tokens that left the queue (trained or dropped as stale), the fraction
        # dropped, overall and by episode length; a length with no tokens is left out.
        fractions = {f"stale_dropped_token_fraction{key}": tokens[True, key] / total
                     for key in ("", *self._len_keys)
                     if (total := tokens[True, key] + tokens[False, key])}
        return {**gauges, **counts, **fractions}

    def state_dict(self) -> dict[str, Any]:
        """The dataset position, and [admission number, sample id] of groups to re-admit."""
        with self._cond:
            pending = sorted([*self._pending, *self._inflight.items()])
            return {
                "position": self._position,
                "version": self._version,
                "consumed": self._accepted - len(self._queue),  # accepted: consumed or queued
                "admitted": self._admitted,
                "pending": [list(p) for p in pending],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before `start()`: groups in flight at save time are admitted again first."""
        if self._portal is not None:
            raise RuntimeError("load_state_dict() before start()")
        self._position = int(state["position"])
        self._version = int(state["version"])
        self._accepted = int(state["consumed"])
        self._admitted = int(state["admitted"])
        self._pending = deque((int(n), int(i)) for n, i in state["pending"])

    # -- the event loop -----------------------------------------------------------------

    def _retire_locked(self, groups: list[_Group], stale: bool) -> None:
        """`groups` left the queue, trained or dropped as stale: count their model tokens."""
        for g in groups:
            del self._inflight[g.serial]
            for ep in g.episodes:
                n = ep.num_trainable_tokens
                self._tokens[stale, ""] += n
                self._tokens[stale, self._len_keys[min(n // self._len_width, 3)]] += n

    def _count(self, key: str, n: int = 1) -> None:
        # under the lock: stats() swaps the counter from the trainer thread
        with self._cond:
            self._counts[key] += n

    def _wake(self) -> None:
        if self._portal is not None:
            with contextlib.suppress(RuntimeError):  # the portal is shutting down
                self._portal.call(self._notify)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _admit_locked(self) -> tuple[int, int] | None:
        """Admit a group if the limits allow (module docstring): (admission number, sample id)."""
        c = self.config
        if self._paused or self._fatal is not None or not (
            self._running_episodes + c.group_size <= c.max_concurrent
            and (c.max_staleness + self._version + 1) * c.batch_size
            > self._accepted + self._running_groups
        ):
            return None
        serial, sample_id = self._next_admission()
        self._inflight[serial] = sample_id
        self._running_groups += 1
        self._running_episodes += c.group_size
        self._peak_running = max(self._peak_running, self._running_episodes)
        self._counts["admitted_groups"] += 1
        return serial, sample_id

    async def _admit_forever(self) -> None:
        try:
            with self._cancel:
                async with anyio.create_task_group() as tg:
                    while True:
                        self._changed = anyio.Event()
                        with self._cond:
                            admitted = self._admit_locked()
                        if admitted is None:
                            await self._changed.wait()
                        else:
                            tg.start_soon(self._run_group, *admitted)
        except Exception as exc:  # a bug in the scheduler must not leave the trainer waiting
            log.exception("rollout scheduler crashed")
            self._fail(RolloutError(f"the rollout scheduler crashed: {exc!r}"))

    def _next_admission(self) -> tuple[int, int]:
        """(admission number, sample id): groups to re-admit first, then the dataset order."""
        if self._pending:
            return self._pending.popleft()
        serial, self._admitted = self._admitted, self._admitted + 1
        epoch, k = divmod(self._position, len(self.dataset))
        self._position += 1
        if epoch not in self._permutations:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._permutations = {epoch: order}
        return serial, self._permutations[epoch][k]

    async def _run_group(self, serial: int, sample_id: int) -> None:
        group, outcome = None, "cancelled"
        try:
            group, outcome = await self._attempt(serial, sample_id, self.dataset[sample_id],
                                                 self.config.group_size, self.sampling,
                                                 training=True)
        finally:
            with self._cond:
                self._running_groups -= 1
                self._running_episodes -= self.config.group_size
                if group is None or not self._accept_locked(group):
                    del self._inflight[serial]
                    if group is None:
                        self._counts[outcome] += 1
                self._cond.notify_all()
            self._notify()

    def _accept_locked(self, group: _Group) -> bool:
        episodes = group.episodes
        if self._flat_dropped < self.config.filter_flat_groups and len(episodes) > 1 and \
                not has_reward_variance(episodes):  # dynamic sampling, bounded per batch
            self._flat_dropped += 1
            self._counts["dropped_flat_groups"] += 1
            self._counts["dropped_flat_tokens"] += sum(ep.num_trainable_tokens for ep in episodes)
            return False
        small = len(episodes) < self.config.min_group_size
        if small or not all(f(episodes) for f in self.filters):
            self._counts["dropped_small_groups" if small else "dropped_filtered_groups"] += 1
            self._consecutive_drops += 1
            self._consecutive_empty += not episodes
            if self._consecutive_drops >= max(50 * self.config.batch_size, 200):
                self._fail(RolloutError(
                    f"workflow {self.workflow.name!r} returned None (expected an Episode; None "
                    f"rejects one) for every episode of the last {self._consecutive_drops} "
                    "groups; no batch can be built. Return ctx.episode(...)"
                    if self._consecutive_empty == self._consecutive_drops else
                    f"the last {self._consecutive_drops} groups were all dropped (too small or "
                    "rejected by a filter such as dynamic sampling); no batch can be built. "
                    "Check min_group_size, group_size and the filters"))
            return False
        self._queue.append(group)
        self._accepted += 1
        self._counts["accepted_groups"] += 1
        self._consecutive_failures = self._consecutive_drops = self._consecutive_empty = 0
        return True

    async def _attempt(self, serial: int, sample_id: int, sample: Any, group_size: int,
                       sampling: SamplingParams, training: bool) -> tuple[_Group | None, str]:
        """One group, retried whole unless `_SAME_AGAIN`: (group, "") or (None, why not)."""
        tries = self.config.max_retries + 1
        for attempt in range(tries):
            try:
                episodes = await self._episodes(serial, sample_id, sample, group_size, attempt,
                                                sampling, training)
            except PromptTooLong as exc:
                log.info("sample %s skipped: %s", sample_id, exc)
                return None, "skipped_long_prompts"
            except (RunEndingError, ImportError) as exc:  # not the row's: no retry, no workflow
                if isinstance(exc, ImportError):  # error; every row would fail the same way
                    exc = RunEndingError(f"workflow {self.workflow.name!r} needs a package that "
                                         f"is not installed: {exc}")
                if not training:
                    raise  # the evaluation's caller ends the run
                self._fail(exc)  # the next prepare_batch raises it
                return None, "failed_samples"
            except Exception as exc:
                if training:
                    self._count("workflow_errors")
                same_again = isinstance(exc, _SAME_AGAIN)
                fields = ", ".join(map(str, sample)) if isinstance(sample, dict) else "?"
                last = (f"{exc!r} (the row's fields: {fields}; not retried: the same row fails "
                        "the same way)" if same_again else
                        f"{exc!r} (attempt {attempt + 1} of {tries})")
                log.warning("workflow %r failed on sample %s: %s", self.workflow.name,
                            sample_id, last, exc_info=exc)
                if same_again:
                    break
            else:
                kept = [ep for ep in episodes if ep is not None]
                if training:
                    self._count("rejected_episodes", len(episodes) - len(kept))
                return _Group(serial, sample_id, kept), ""
        if training:
            with self._cond:
                self._consecutive_failures += 1
                if self._consecutive_failures >= max(self.config.batch_size, 3):
                    self._fail(RolloutError(
                        f"workflow {self.workflow.name!r} failed on {self._consecutive_failures} "
                        f"samples in a row; last error on sample {sample_id}: {last}"))
        return None, "failed_samples"

    async def _episodes(self, serial: int, sample_id: int, sample: Any, group_size: int,
                        attempt: int, sampling: SamplingParams,
                        training: bool) -> list[Episode | None]:
        results: list[Episode | None] = [None] * group_size

        async def one(i: int) -> None:
            # seeds from where the episode stands in the run, never from what ran before it
            seed = derived_seed(self.seed, "train" if training else "eval", serial, attempt, i)
            ctx = RolloutContext(
                pool=self.pool, tokenizer=self.tokenizer, score=self._score,
                sampling=sampling, episode_id=f"{sample_id}/{attempt}/{i}",
                config=self.workflow_config, max_prompt_tokens=self.config.max_prompt_tokens,
                seed=seed, endpoint=self.openai_endpoint)
            try:
                episode = await self.workflow.fn(ctx, sample)
            except Exception:
                if ctx.over_budget is None:
                    raise
            finally:
                ctx.close()
            if ctx.over_budget is not None:  # an agent's prompt over budget: skipped as in rlvr
                raise ctx.over_budget
            if episode is not None and not isinstance(episode, Episode):
                raise TypeError(f"workflow {self.workflow.name!r} returned "
                                f"{type(episode).__name__}; expected an Episode or None")
            if episode is not None:
                episode.info.setdefault("sample_id", sample_id)
                episode.metrics = {**ctx.metrics, **episode.metrics}  # the workflow's own win
                episode.rates = {*ctx.rates, *episode.rates}
                _check_metrics(self.workflow.name, episode.metrics, episode.rates)
            results[i] = episode

        await _run_all(one, group_size)
        return results

    async def _rollout_now(self, samples: list[dict[str, Any]], sampling: SamplingParams,
                           group_size: int) -> list[list[Episode]]:
        out: list[list[Episode]] = [[] for _ in samples]
        limit = anyio.CapacityLimiter(max(1, self.config.max_concurrent // group_size))
        async def run(i: int) -> None:
            async with limit:
                group, _ = await self._attempt(i, -1 - i, samples[i], group_size, sampling,
                                               training=False)
                out[i] = group.episodes if group is not None else []

        await _run_all(run, len(samples))
        return out

    # -- failure ------------------------------------------------------------------------

    def _fail(self, error: Exception) -> None:
        with self._cond:  # an RLock: callers may hold it already
            if self._fatal is None:
                self._fatal = error
            self._cond.notify_all()

    def _drop_stale_locked(self) -> int:
        oldest_allowed = self._version - self.config.max_staleness
        fresh, stale = deque(), []
        for g in self._queue:
            (stale if g.oldest_version() < oldest_allowed else fresh).append(g)
        if stale:
            self._queue = fresh
            self._accepted -= len(stale)
            self._counts["dropped_stale_groups"] += len(stale)
            self._retire_locked(stale, stale=True)
        return len(stale)


def _check_metrics(workflow: str, metrics: dict[str, Any], rates: set[str]) -> None:
    if unknown := sorted(rates - set(metrics)):
        raise ValueError(f"workflow {workflow!r}: episode.rates names {unknown}, which "
                         f"episode.metrics does not hold (it holds {sorted(metrics)})")
    for name, value in metrics.items():
        if not isinstance(name, str) or "/" in name or not name:
            raise ValueError(f"workflow {workflow!r}: episode metric name {name!r} must be a "
                             "plain word (no '/': eval adds the 'eval/' prefix)")
        if not isinstance(value, int | float):  # bools count as 0 / 1
            raise TypeError(f"workflow {workflow!r}: episode.metrics[{name!r}] is "
                            f"{type(value).__name__} {value!r}; a metric is a number, averaged "
                            "over the batch")
        if name in rates and value not in (0, 1):
            raise ValueError(f"workflow {workflow!r}: episode.metrics[{name!r}] is {value!r}, "
                             "but it is declared a rate (episode.rates, or its reward's "
                             "`rates`): a rate is 0 or 1; leave it out of the rates if it is "
                             "a value")
