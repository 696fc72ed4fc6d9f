"""Built-in workflows and RolloutContext, driven by a pool that replies with scripted text (the
real engine drives them in test_rollout_e2e.py)."""

from __future__ import annotations

import asyncio

import pytest

from areal_flow import workflows
from areal_flow.reward.runner import RewardRunner
from areal_flow.types import Completion, SamplingParams
from areal_flow.workflow.context import PromptTooLong, RolloutContext
from areal_flow.workflow.multi_turn import MultiTurnConfig
from areal_flow.agents.tool_use import calculate


class TextPool:
    """Replies with the next scripted text, ending it with EOS like a model that stopped."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.version, self.prompts = tokenizer, iter(replies), 0, []

    async def generate(self, request):
        self.prompts.append(list(request.input_ids))
        text = next(self.replies)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[3] * len(ids),
                          finish_reason="stop", text=text)


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(max_workers=1) as r:
        yield r


def run(name, tokenizer, runner, replies, sample, config=None, max_prompt_tokens=None):
    pool = TextPool(tokenizer, replies)
    ctx = RolloutContext(pool=pool, tokenizer=tokenizer, score=runner.score,
                         sampling=SamplingParams(max_new_tokens=32), episode_id="0/0/0",
                         config=config, max_prompt_tokens=max_prompt_tokens)
    return asyncio.run(workflows.get(name)(ctx, sample)), pool


SAMPLE = {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"}


def test_rlvr_builds_one_scored_turn(tokenizer, runner):
    episode, pool = run("rlvr", tokenizer, runner, ["It is 7.\n#### 7"], SAMPLE)
    prompt = pool.prompts[0]
    assert tokenizer.decode(prompt) == (
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    assert episode.reward == 1.0
    assert episode.token_ids[: len(prompt)] == prompt
    assert episode.loss_mask == [False] * len(prompt) + [True] * (episode.num_tokens - len(prompt))
    assert set(episode.versions[len(prompt):]) == {3}
    wrong, _ = run("rlvr", tokenizer, runner, ["#### 8"], SAMPLE)
    assert wrong.reward == 0.0


def test_multi_turn_retries_with_feedback_and_discounts(tokenizer, runner):
    episode, pool = run("multi_turn", tokenizer, runner, ["#### 5", "#### 7"], SAMPLE,
                        config=MultiTurnConfig(discount=0.5))
    assert episode.reward == 0.5 and episode.metrics["turns"] == 2
    kinds = [(s.trainable, tokenizer.decode(s.token_ids)) for s in episode.segments]
    assert kinds[1] == (True, "#### 5<|im_end|>") and kinds[3] == (True, "#### 7<|im_end|>")
    assert kinds[2] == (False, "\n<|im_start|>user\nThat is not correct. Please try again."
                               "<|im_end|>\n<|im_start|>assistant\n")
    # the token stream is exactly what the chat template renders for the whole conversation
    conversation = [{"role": "user", "content": SAMPLE["question"]},
                    {"role": "assistant", "content": "#### 5"},
                    {"role": "user", "content": "That is not correct. Please try again."},
                    {"role": "assistant", "content": "#### 7"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(episode.token_ids) + "\n" == rendered
    # the second turn continued from the first turn's tokens, not from re-tokenized text
    assert pool.prompts[1] == episode.token_ids[: len(pool.prompts[1])]


def test_multi_turn_stops_at_the_turn_limit(tokenizer, runner):
    episode, _ = run("multi_turn", tokenizer, runner, ["#### 1", "#### 2", "#### 3"], SAMPLE,
                     config=MultiTurnConfig(max_turns=3, discount=0.9))
    assert episode.metrics["turns"] == 3 and episode.reward == 0.0


def test_tool_use_inserts_the_calculator_result_as_environment_tokens(tokenizer, runner):
    episode, pool = run("tool_use", tokenizer, runner,
                        ["First <calc>3 + 4</calc> and text the tool call must cut off",
                         "So the answer is #### 7"], SAMPLE)
    texts = [(s.trainable, tokenizer.decode(s.token_ids)) for s in episode.segments[1:]]
    assert texts == [(True, "First <calc>3 + 4</calc>"), (False, "<result>7</result>\n"),
                     (True, "So the answer is #### 7<|im_end|>")]
    assert episode.reward == 1.0
    assert pool.prompts[1] == episode.token_ids[: len(pool.prompts[1])]


@pytest.mark.parametrize(
    ("expression", "result"),
    [("2 + 3 * 4", "14"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("-2 ** 2", "-4"),
     ("2 ** 1000", "error: ValueError"), ("__import__('os').system('true')", "error: ValueError"),
     ("open('x')", "error: ValueError"), ("1 / 0", "error: ZeroDivisionError"),
     ("1 +", "error: SyntaxError"), ("(1).__class__", "error: ValueError")],
)
def test_the_calculator_only_does_arithmetic(expression, result):
    assert calculate(expression) == result


def test_a_missing_dataset_field_is_named(tokenizer, runner):
    with pytest.raises(KeyError, match="no field 'question' \\(it has: prompt, answer\\)"):
        run("rlvr", tokenizer, runner, ["x"], {"prompt": "hi", "answer": "1"})


def test_prompts_over_the_limit_are_refused(tokenizer, runner):
    with pytest.raises(PromptTooLong, match="exceeds max_prompt_tokens=5"):
        run("rlvr", tokenizer, runner, ["x"], SAMPLE, max_prompt_tokens=5)


def test_stop_at_keeps_tokens_logprobs_and_versions_aligned(tokenizer):
    ctx = RolloutContext(pool=None, tokenizer=tokenizer, score=None, sampling=SamplingParams(),
                         episode_id="e")
    ids = tokenizer.encode("a <calc>1+1</calc> tail", add_special_tokens=False)
    out = Completion(token_ids=ids, logprobs=[-float(i) for i in range(len(ids))],
                     versions=list(range(len(ids))), finish_reason="length")
    cut = ctx.stop_at(out, "</calc>")
    assert tokenizer.decode(cut.token_ids).endswith("</calc>")
    assert not tokenizer.decode(cut.token_ids[:-1]).endswith("</calc>")
    k = len(cut.token_ids)
    assert cut.logprobs == out.logprobs[:k] and cut.versions == out.versions[:k]
    assert cut.finish_reason == "stop"
    assert ctx.stop_at(out, "<absent>") is out
