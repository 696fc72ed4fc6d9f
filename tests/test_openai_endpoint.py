"""An unchanged `openai` agent loop (tool call → tool result → final answer) runs through the
episode's OpenAI-compatible endpoint, in process and over HTTP from another process, and the
episode holds exactly the tokens, logprobs and versions the pool generated."""

from __future__ import annotations

import asyncio
import json
import sys

import anyio
import openai
import pytest

from areal_flow.types import Completion, SamplingParams
from areal_flow.workflow.context import RolloutContext
from areal_flow.workflow.openai_endpoint import OpenAIEndpoint

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                     "b": {"type": "number"}}}}}]
CALL_ADD = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
FINAL = "The sum is 5."


class ScriptedPool:
    """Replies with the scripted texts in order; each token gets its own logprob and version."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.requests, self.served = [], []

    async def generate(self, request):
        ids = [*self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False),
               self.tokenizer.eos_token_id]
        n = len(self.served)
        out = Completion(token_ids=ids, logprobs=[-0.01 * (i + 1) - n for i in range(len(ids))],
                         versions=[7 + n] * len(ids), finish_reason="stop",
                         temperature=request.sampling.logprob_temperature)
        self.requests.append(request)
        self.served.append(out)
        return out


async def agent(client, question: str) -> str:
    """An agent loop as the openai docs write it: nothing in it knows about areal_flow."""
    messages = [{"role": "user", "content": question}]
    while True:
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, temperature=0.7, max_tokens=40)
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(args["a"] + args["b"])})


def context(tokenizer, pool, endpoint=None) -> RolloutContext:
    return RolloutContext(pool=pool, tokenizer=tokenizer, score=None, episode_id="0/0/0",
                          sampling=SamplingParams(max_new_tokens=16), seed=3, endpoint=endpoint)


def check_episode(tokenizer, pool, episode) -> None:
    """Token by token: the first prompt as the template renders it, the model's first turn as
    generated, the tool turn's template tokens (not trained on), the model's second turn."""
    first, second = pool.requests
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    assert list(first.input_ids) == tokenizer.apply_chat_template(
        question, add_generation_prompt=True, tokenize=True)["input_ids"]
    tool_turn = tokenizer.encode("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n",
                                 add_special_tokens=False)
    one, two = pool.served
    assert list(second.input_ids) == [*first.input_ids, *one.token_ids, *tool_turn]
    assert episode.token_ids == [*second.input_ids, *two.token_ids]
    assert episode.loss_mask == [False] * len(first.input_ids) + [True] * len(one.token_ids) + \
        [False] * len(tool_turn) + [True] * len(two.token_ids)
    trained = [i for i, m in enumerate(episode.loss_mask) if m]
    assert [episode.logprobs[i] for i in trained] == [*one.logprobs, *two.logprobs]
    assert [episode.versions[i] for i in trained] == [*one.versions, *two.versions]
    assert episode.temperature == 0.7 and first.sampling.max_new_tokens == 40
    assert episode.info["openai"] == {"calls": 2, "trained_calls": 2, "rewrote_history": False}


def test_an_unchanged_openai_agent_in_a_workflow_records_the_pools_tokens(tokenizer):
    pool = ScriptedPool(tokenizer, [CALL_ADD, FINAL])
    ctx = context(tokenizer, pool)

    async def workflow():
        answer = await agent(ctx.openai_client(), "What is 2 + 3?")
        return answer, ctx.recorded_episode()

    answer, episode = asyncio.run(workflow())
    assert answer == FINAL
    check_episode(tokenizer, pool, episode)


AGENT_SCRIPT = """
import json, sys
import openai

base_url, key = sys.argv[1:3]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
assert [m.id for m in client.models.list().data] == ["tiny"]
tools = json.loads(sys.argv[3])
messages = [{"role": "user", "content": "What is 2 + 3?"}]
while True:
    message = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                             temperature=0.7, max_tokens=40).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        print(message.content)
        break
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": str(args["a"] + args["b"])})
"""


def test_an_agent_in_another_process_reaches_the_episode_over_http(tokenizer):
    pool = ScriptedPool(tokenizer, [CALL_ADD, FINAL])
    endpoint = OpenAIEndpoint(model="tiny")
    ctx, other = context(tokenizer, pool, endpoint), context(tokenizer, pool, endpoint)

    async def workflow():
        access = await ctx.openai_server()
        intruder = openai.AsyncOpenAI(base_url=access.base_url, api_key="episode-guessed",
                                      max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="unknown key"):
            await intruder.chat.completions.create(model="tiny", messages=[
                {"role": "user", "content": "hi"}])
        assert (await other.openai_server()).api_key != access.api_key  # one key per episode
        done = await anyio.run_process([sys.executable, "-c", AGENT_SCRIPT, access.base_url,
                                        access.api_key, json.dumps(TOOLS)])
        episode = ctx.recorded_episode()
        ctx.close()
        with pytest.raises(openai.AuthenticationError):  # the episode is over: its key too
            await openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key,
                                     max_retries=0).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])
        await endpoint.close()
        return done.stdout.decode().strip(), episode

    answer, episode = asyncio.run(workflow())
    assert answer == FINAL
    check_episode(tokenizer, pool, episode)


def test_a_rewritten_history_trains_the_last_chain_and_says_so(tokenizer):
    pool = ScriptedPool(tokenizer, ["first try", "second try"])
    ctx = context(tokenizer, pool)

    async def workflow():
        client = ctx.openai_client()
        await client.chat.completions.create(model="p", messages=[
            {"role": "user", "content": "Say hi."}])
        # the agent summarises instead of sending the reply back: a new token sequence
        await client.chat.completions.create(model="p", messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}])
        return ctx.recorded_episode()

    episode = asyncio.run(workflow())
    assert episode.info["openai"] == {"calls": 2, "trained_calls": 1, "rewrote_history": True}
    assert episode.token_ids == [*pool.requests[1].input_ids, *pool.served[1].token_ids]


def test_n_choices_stop_strings_and_the_choice_the_agent_continues(tokenizer):
    pool = ScriptedPool(tokenizer, ["alpha END beta", "gamma", "delta"])
    ctx = context(tokenizer, pool)

    async def workflow():
        client = ctx.openai_client()
        messages = [{"role": "user", "content": "Go."}]
        response = await client.chat.completions.create(model="p", messages=messages, n=2,
                                                        stop=["END"])
        texts = [c.message.content for c in response.choices]
        chosen = response.choices[1].message  # the agent keeps the second choice
        await client.chat.completions.create(model="p", messages=[
            *messages, chosen, {"role": "user", "content": "More."}])
        return texts, response.usage, ctx.recorded_episode()

    texts, usage, episode = asyncio.run(workflow())
    assert texts == ["alpha ", "gamma"]
    cut = pool.served[0]  # the stop string ended the first choice: its later tokens are gone
    assert usage.completion_tokens < len(cut.token_ids) + len(pool.served[1].token_ids)
    assert episode.info["openai"] == {"calls": 3, "trained_calls": 2, "rewrote_history": False}
    second = pool.served[1]
    assert pool.requests[2].input_ids[:len(pool.requests[0].input_ids) + len(second.token_ids)] \
        == (*pool.requests[0].input_ids, *second.token_ids)


def test_a_streaming_agent_gets_the_whole_reply_as_chunks_and_the_same_recording(tokenizer):
    pool = ScriptedPool(tokenizer, [CALL_ADD, FINAL])
    ctx = context(tokenizer, pool)

    async def workflow():
        client = ctx.openai_client()
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        stream = await client.chat.completions.create(
            model="p", messages=messages, tools=TOOLS, temperature=0.7, max_tokens=40,
            stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        call = chunks[0].choices[0].delta.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == \
            ("add", {"a": 2, "b": 3})
        assert chunks[0].choices[0].finish_reason == "tool_calls"
        assert chunks[-1].usage.completion_tokens == len(pool.served[0].token_ids)
        # the agent sends back what it assembled from the chunks
        messages += [{"role": "assistant", "content": chunks[0].choices[0].delta.content,
                      "tool_calls": [{"id": call.id, "type": "function", "function": {
                          "name": "add", "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        stream = await client.chat.completions.create(
            model="p", messages=messages, tools=TOOLS, temperature=0.7, max_tokens=40,
            stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        return text, ctx.recorded_episode()

    text, episode = asyncio.run(workflow())
    assert text == FINAL
    check_episode(tokenizer, pool, episode)
