"""LLM-as-judge (`ctx.judge`, `areal_flow.judges.judge`): the score parsed from any reply that
ends in a Score line, the default for junk, out-of-range scores and a judge that never answers,
a separate judge pool, the judge's tokens kept out of the episode, and a run trained on it."""

from __future__ import annotations

import asyncio
import json
import time

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow.judges.judge import PROMPT, Judge, parse_score
from areal_flow.types import Completion, SamplingParams, derived_seed
from areal_flow.workflow.context import RolloutContext
from tests.helpers import ScriptedPool, metrics, run_recipe

QUESTION = "What is 2 plus 3?"
RUBRIC = "Full marks for the right number."


class RecordingPool(ScriptedPool):
    """A ScriptedPool that also keeps every request (its sampling settings)."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, replies)
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        return await super().generate(request)


class TextPool:
    """Replies with one fixed text to every request."""

    def __init__(self, text: str):
        self.text = text

    async def generate(self, request):
        return Completion(token_ids=[5], logprobs=[-0.1], versions=[0], finish_reason="stop",
                          text=self.text)


class SilentPool:
    """Never answers: waits on an event nobody sets, and notes that it was cancelled."""

    def __init__(self):
        self.started = self.cancelled = 0

    async def generate(self, request):
        self.started += 1
        try:
            await anyio.Event().wait()
        except BaseException:
            self.cancelled += 1
            raise


def context(tokenizer, pool, **kwargs) -> RolloutContext:
    async def no_reward(*args, **kw):
        raise AssertionError("the judge must not call the reward runner")

    return RolloutContext(pool=pool, tokenizer=tokenizer, score=no_reward,
                          sampling=SamplingParams(max_new_tokens=16, temperature=1.0),
                          episode_id="0/0/0", **kwargs)


# ----------------------------------------------------------------------------------- parsing

SCALES = st.sampled_from([(0, 10), (1, 5), (0, 1), (-5, 5), (0, 100)])
LINES = st.sampled_from(["Score: {n}", "score: {n}", "SCORE:{n}", "**Score:** {n}",
                         "Score: **{n}**", "Score = {n}", "Score: {n}.", "Score: {n}/{hi}",
                         "Final Score: {n}"])


@st.composite
def scored(draw):
    """(reply text ending in a Score line, scale, the number written)."""
    low, high = draw(SCALES)
    n = draw(st.decimals(min_value=low, max_value=high, places=draw(st.integers(0, 2))))
    line = draw(LINES).format(n=n, hi=high)
    text = draw(st.text(max_size=200)) + "\n" + line + draw(st.sampled_from(["", "\n", "  \n"]))
    return text, (low, high), float(n)


@settings(max_examples=200, deadline=None)
@given(scored())
def test_any_reply_ending_in_a_score_line_parses_to_its_number(tokenizer, case):
    text, (low, high), n = case
    assert parse_score(text, (low, high)) == ("parsed", n)
    ctx = context(tokenizer, TextPool(text))
    score = asyncio.run(ctx.judge(RUBRIC, "5", scale=(low, high), default=-1.0))
    assert score == pytest.approx((n - low) / (high - low))
    assert 0.0 <= score <= 1.0
    assert ctx.metrics == {"judge_parsed": 1.0, "judge_out_of_range": 0.0,
                           "judge_timeout": 0.0}


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=300).filter(lambda t: "score" not in t.lower()))
def test_a_reply_without_a_score_line_scores_the_default(tokenizer, text):
    assert parse_score(text) == ("no_score", None)
    ctx = context(tokenizer, TextPool(text))
    assert asyncio.run(ctx.judge(RUBRIC, "5", default=0.25)) == 0.25
    assert ctx.metrics == {"judge_parsed": 0.0, "judge_out_of_range": 0.0,
                           "judge_timeout": 0.0}


@settings(max_examples=50, deadline=None)
@given(st.one_of(st.integers(11, 10**6), st.integers(-10**6, -1)), st.text(max_size=100))
def test_a_score_outside_the_scale_scores_the_default(tokenizer, n, prefix):
    text = f"{prefix}\nScore: {n}"
    assert parse_score(text, (0, 10)) == ("out_of_range", float(n))
    ctx = context(tokenizer, TextPool(text))
    assert asyncio.run(ctx.judge(RUBRIC, "5", default=0.5)) == 0.5
    assert ctx.metrics["judge_out_of_range"] == 1.0 and ctx.metrics["judge_parsed"] == 0.0


@pytest.mark.parametrize(("text", "expected"), [
    ("Score: 3\nOn reflection, Score: 8", ("parsed", 8.0)),  # the last one counts
    ("Score: 1e5", ("no_score", None)),  # not a plain number
    ("Subscore: 4", ("no_score", None)),
    ("Score:\n7", ("no_score", None)),  # the number must be on the Score line
    ("Score: 7.5, well argued", ("parsed", 7.5)),
])
def test_parse_score_edge_cases(text, expected):
    assert parse_score(text, (0, 10)) == expected


def test_the_outcome_metrics_are_fractions_over_the_episodes_judge_calls(tokenizer):
    pool = ScriptedPool(tokenizer, [("Score: 10", "stop"), ("no idea", "stop"),
                                    ("Score: 11", "stop"), ("Score: 0", "stop")])
    ctx = context(tokenizer, pool)
    scores = [asyncio.run(ctx.judge(RUBRIC, "5", default=0.5)) for _ in range(4)]
    assert scores == [1.0, 0.5, 0.5, 0.0]
    assert ctx.metrics == {"judge_parsed": 0.5, "judge_out_of_range": 0.25,
                           "judge_timeout": 0.0}


def test_a_bad_scale_is_refused():
    with pytest.raises(ValueError, match="scale"):
        Judge(scale=(5, 5))
    with pytest.raises(ValueError, match="timeout"):
        Judge(timeout=0)


# ----------------------------------------------------------------------------------- timeout


def test_a_judge_that_never_answers_scores_the_default_within_the_timeout(tokenizer):
    pool = SilentPool()
    ctx = context(tokenizer, pool)
    start = time.monotonic()
    # the outer bound turns a judge without its own timeout into a failure, not a hung suite
    score = asyncio.run(asyncio.wait_for(ctx.judge(RUBRIC, "5", timeout=0.2, default=0.125), 10))
    elapsed = time.monotonic() - start
    assert score == 0.125
    assert 0.2 <= elapsed < 5.0
    assert pool.started == 1 and pool.cancelled == 1  # the request itself was cancelled
    assert ctx.metrics == {"judge_parsed": 0.0, "judge_out_of_range": 0.0,
                           "judge_timeout": 1.0}


# ----------------------------------------------------------------------------------- pools


def test_a_separate_judge_pool_gets_the_judge_prompt_greedy(tokenizer):
    policy = RecordingPool(tokenizer, [])  # any call to it fails: the script is empty
    judge = RecordingPool(tokenizer, [("The answer is right.\nScore: 7", "stop")])
    ctx = context(tokenizer, policy, seed=11)
    score = asyncio.run(ctx.judge(RUBRIC, "It is 5.", question=QUESTION, pool=judge))
    assert score == pytest.approx(0.7)
    assert policy.requests == [] and len(judge.requests) == 1
    request = judge.requests[0]
    assert request.sampling.temperature == 0.0 and request.sampling.seed is None
    assert request.sampling.max_new_tokens == 16  # the run's, unless overridden
    rendered = PROMPT.format(rubric=RUBRIC, question_block=f"\nQuestion:\n{QUESTION}\n",
                             completion="It is 5.", low=0, high=10)
    assert tokenizer.decode(request.input_ids) == tokenizer.apply_chat_template(
        [{"role": "user", "content": rendered}], tokenize=False, add_generation_prompt=True)
    assert 'end your reply with a line of the form "Score: N", where N is a number from 0 ' \
           "to 10" in rendered


def test_sampling_overrides_reach_the_judge_request_with_a_seed_of_its_own(tokenizer):
    judge = RecordingPool(tokenizer, [("Score: 2", "stop")] * 2)
    ctx = context(tokenizer, judge, seed=3)
    asyncio.run(ctx.judge(RUBRIC, "x", temperature=0.7, max_new_tokens=64))
    asyncio.run(ctx.judge(RUBRIC, "x", temperature=0.7))
    first, second = (r.sampling for r in judge.requests)
    assert (first.temperature, first.max_new_tokens) == (0.7, 64)
    assert first.seed == derived_seed(3, "judge", 0) and second.seed == derived_seed(3, "judge", 1)


def test_the_judges_tokens_never_enter_the_episode(tokenizer):
    """The policy's pool judges its own turn: the episode is the prompt and that turn only, and
    the policy's next sampled call gets the seed it would have had without the judge."""
    pool = RecordingPool(tokenizer, [("It is 5.", "stop"), ("Correct.\nScore: 9", "stop"),
                                     ("Again 5.", "stop")])
    ctx = context(tokenizer, pool, seed=5)

    async def workflow():
        prompt = ctx.chat([{"role": "user", "content": QUESTION}])
        out = await ctx.generate(prompt)
        score = await ctx.judge(RUBRIC, out.text, question=QUESTION)
        episode = ctx.episode(prompt, out, reward=score)
        await ctx.generate(prompt)  # a second policy call after the judge's
        return prompt, out, episode

    prompt, out, episode = asyncio.run(workflow())
    assert episode.reward == pytest.approx(0.9)
    assert [(s.trainable, tokenizer.decode(s.token_ids)) for s in episode.segments] == [
        (False, tokenizer.decode(prompt)), (True, "It is 5.<|im_end|>")]
    assert episode.token_ids == [*prompt, *out.token_ids]
    assert "Correct." not in tokenizer.decode(episode.token_ids)
    assert RUBRIC in tokenizer.decode(pool.requests[1].input_ids)
    assert [r.sampling.seed for r in pool.requests] == [derived_seed(5, 0), None,
                                                        derived_seed(5, 1)]
    assert ctx.metrics["judge_parsed"] == 1.0


# ----------------------------------------------------------------------------------- training


def test_a_workflow_judged_by_the_policy_trains_on_the_tiny_model(tiny_model_dir, gsm8k_file,
                                                                  tmp_path):
    run_dir = tmp_path / "run"
    result = run_recipe("gsm8k_grpo.py", [
        "--model", str(tiny_model_dir), "--dataset", str(gsm8k_file), "--run-dir", str(run_dir),
        "--steps", "2", "--eval-size", "0", "--rollout.batch-size", "2",
        "--rollout.group-size", "2", "--sampling.max-new-tokens", "8",
        "--inference.dtype", "float32", "--train.dtype", "float32", "--samples-per-step", "4",
        "--workflow", "tests.workflows_for_tests:judged"])
    trained = [m for m in metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2]
    for m in trained:
        # the tiny model never writes a Score line: every judge call failed, and the panel
        # says so rather than training on silent zeros
        assert m["judge_parsed"] == 0.0 and m["judge_timeout"] == 0.0, m
        assert m["reward/mean"] == 0.0
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(" judge_parsed " in line for line in steps), steps
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples
    for sample in samples:  # the prompt, then the policy's turn: no judge tokens
        assert [s["trained"] for s in sample["segments"]] == [False, True], sample["segments"]
        assert "Rubric" not in json.dumps(sample["segments"])
        assert sample["metrics"]["judge_parsed"] == 0.0
