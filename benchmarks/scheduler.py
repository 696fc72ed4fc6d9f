"""Rollout scheduler overhead with a zero-latency pool.

The same trivial workflow (one generate call, one episode) runs two ways:
  scheduler — RolloutScheduler with admission, grouping, queueing, prepare_batch and collation
  bare      — asyncio.gather over the workflow calls, no accounting at all
Reports episodes per second for both and the scheduler's cost per episode in microseconds.

    python benchmarks/scheduler.py [--quick] [--out benchmarks/results/scheduler.json]
"""

from __future__ import annotations

import asyncio
import time

from areal_flow.config import RolloutConfig
from areal_flow.rollout.scheduler import RolloutScheduler
from areal_flow.types import Completion, SamplingParams, WorkflowSpec
from areal_flow.workflow.context import RolloutContext
from common import main, markdown_table

PROMPT = list(range(1, 33))


class ZeroLatencyPool:
    version = 0

    async def generate(self, request):
        return Completion(token_ids=[7] * 16, logprobs=[-1.0] * 16, versions=[self.version] * 16,
                          finish_reason="length")


async def one_turn(ctx, sample):
    return ctx.episode(PROMPT, await ctx.generate(PROMPT), reward=float(sample["id"] % 2))


class Tokenizer:
    pad_token_id = 0


async def unused(*args, **kwargs):
    raise AssertionError


def bare(episodes: int) -> float:
    pool = ZeroLatencyPool()

    async def main():
        ctxs = [RolloutContext(pool=pool, tokenizer=Tokenizer(), score=unused,
                               sampling=SamplingParams(), episode_id=str(i))
                for i in range(episodes)]
        await asyncio.gather(*(one_turn(c, {"id": i}) for i, c in enumerate(ctxs)))

    start = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - start


def scheduled(batches: int, batch_size: int, group_size: int) -> float:
    pool = ZeroLatencyPool()
    config = RolloutConfig(batch_size=batch_size, group_size=group_size, max_staleness=2,
                           max_concurrent=4 * batch_size * group_size)
    scheduler = RolloutScheduler(
        pool=pool, workflow=WorkflowSpec(name="one_turn", fn=one_turn),
        dataset=[{"id": i} for i in range(1000)], tokenizer=Tokenizer(), score=unused,
        config=config, sampling=SamplingParams())
    with scheduler:
        scheduler.prepare_batch(timeout=60)  # warm-up
        start = time.perf_counter()
        for step in range(batches):
            scheduler.prepare_batch(timeout=60)
            pool.version = step + 1
            scheduler.set_version(step + 1)
        return time.perf_counter() - start


def run(quick: bool = False) -> dict:
    batch_size, group_size = 32, 8
    batches = 5 if quick else 30
    episodes = batches * batch_size * group_size
    t_sched = scheduled(batches, batch_size, group_size)
    t_bare = bare(episodes)
    return {
        "benchmark": "scheduler", "episodes": episodes, "batch_size": batch_size,
        "group_size": group_size,
        "scheduler_episodes_per_s": episodes / t_sched,
        "bare_episodes_per_s": episodes / t_bare,
        "overhead_us_per_episode": (t_sched - t_bare) / episodes * 1e6,
        "slowdown": t_sched / t_bare,
    }


def show(r: dict) -> None:
    print(f"scheduler overhead: {r['episodes']} episodes, zero-latency pool\n")
    print(markdown_table(
        ["scheduler ep/s", "bare gather ep/s", "slowdown", "overhead µs/episode"],
        [[f"{r['scheduler_episodes_per_s']:.0f}", f"{r['bare_episodes_per_s']:.0f}",
          f"{r['slowdown']:.2f}x", f"{r['overhead_us_per_episode']:.0f}"]]))


if __name__ == "__main__":
    main(__doc__, run, show, "scheduler")
