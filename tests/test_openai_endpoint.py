"""An unchanged `openai` agent loop (tool call → tool result → final answer) runs through the
episode's OpenAI-compatible endpoint, in process and over HTTP from another process, and the
episode holds exactly the tokens, logprobs and versions the pool generated."""

from __future__ import annotations

import asyncio
import json
import sys

import anyio
import pytest

openai = pytest.importorskip("openai",
                             reason="the agents' endpoint: pip install 'areal-flow[agents]'")

from areal_flow import workflow
from areal_flow.types import Completion, SamplingParams
from areal_flow.workflow.context import RolloutContext
from areal_flow.agents.openai_endpoint import OpenAIEndpoint

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
                          sampling=SamplingParams(max_new_tokens=16), seed=3,
                          endpoint=None if endpoint is None else lambda: endpoint)


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
    assert episode.info["openai"] == {"calls": 2, "trained_calls": 2, "rewrote_history": False,
                                      "rerendered": 0}


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
    assert episode.info["openai"] == {"calls": 2, "trained_calls": 1, "rewrote_history": True,
                                      "rerendered": 0}
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
        assert response.model == "p"  # any `model` is taken (the policy answers) and echoed
        chosen = response.choices[1].message  # the agent keeps the second choice
        await client.chat.completions.create(model="p", messages=[
            *messages, chosen, {"role": "user", "content": "More."}])
        return texts, response.usage, ctx.recorded_episode()

    texts, usage, episode = asyncio.run(workflow())
    assert texts == ["alpha ", "gamma"]
    cut = pool.served[0]  # the stop string ended the first choice: its later tokens are gone
    assert usage.completion_tokens < len(cut.token_ids) + len(pool.served[1].token_ids)
    assert episode.info["openai"] == {"calls": 3, "trained_calls": 2, "rewrote_history": False,
                                      "rerendered": 0}
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


# ------------------------------------------------------------ seeds, choices, turn boundaries

class SeedPool:
    """Replies 'ok'; remembers each request's seed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seeds = tokenizer, []

    async def generate(self, request):
        self.seeds.append(request.sampling.seed)
        ids = [*self.tokenizer.encode("ok", add_special_tokens=False), self.tokenizer.eos_token_id]
        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[0] * len(ids),
                          finish_reason="stop")


def test_a_seed_the_agent_fixes_differs_per_choice_and_episode_and_replays_the_same(tokenizer):
    """An agent that always sends seed=5 still samples each choice, turn and episode of a group
    differently (else every advantage is 0), and the same run replays the same seeds."""
    def group(run_seed: int) -> list[int]:
        pool = SeedPool(tokenizer)

        async def episode(i: int) -> None:
            ctx = RolloutContext(pool=pool, tokenizer=tokenizer, score=None,
                                 episode_id=f"0/0/{i}", sampling=SamplingParams(),
                                 seed=run_seed + i)
            client = ctx.openai_client()
            messages = [{"role": "user", "content": "Go."}]
            reply = await client.chat.completions.create(model="p", messages=messages, n=2,
                                                         seed=5)
            await client.chat.completions.create(model="p", seed=5, messages=[
                *messages, reply.choices[0].message, {"role": "user", "content": "Again."}])

        async def main():
            for i in range(3):
                await episode(i)
        asyncio.run(main())
        return pool.seeds

    seeds = group(100)
    assert len(seeds) == 9 and len(set(seeds)) == 9  # 3 episodes × (2 choices + 1)
    assert all(-2**63 <= s < 2**63 for s in seeds)
    assert group(100) == seeds  # reproducible: a pure function of the run's seed


def test_the_trained_chain_ends_in_the_choice_the_agent_answered_with(tokenizer):
    pool = ScriptedPool(tokenizer, ["alpha", "beta", "gamma"])
    ctx = context(tokenizer, pool)

    async def workflow():
        await ctx.openai_client().chat.completions.create(
            model="p", n=3, messages=[{"role": "user", "content": "Go."}])

    asyncio.run(workflow())
    prompt = list(pool.requests[0].input_ids)
    for choice in range(3):
        assert ctx.recorded_episode(choice).token_ids == [*prompt,
                                                          *pool.served[choice].token_ids]
    assert ctx.recorded_episode().token_ids == [*prompt, *pool.served[0].token_ids]  # default
    with pytest.raises(ValueError, match=r"choice=3: the last request made choices 0 to 2"):
        ctx.recorded_episode(3)


def with_template(tokenizer, template: str, specials: list[str], eos: str):
    """A copy of the tiny tokenizer with another chat template and end-of-sequence token."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template, tok.eos_token = template, eos
    return tok


# ChatML as Qwen2.5 ships it: the turn ends with <|im_end|> and a newline, EOS is <|endoftext|>
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Gemma's: the model's role is 'model', a turn ends with <end_of_turn> and a newline, EOS <eos>
GEMMA = ("{{ '<bos>' }}{% for m in messages %}{% set role = 'model' if m['role'] == "
         "'assistant' else m['role'] %}{{ '<start_of_turn>' + role + '\n' + m['content'] | trim"
         " + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
TEMPLATES = {"chatml-eos-endoftext": (CHATML, [], "<|endoftext|>", "<|im_end|>"),
             "gemma": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"], "<eos>",
                       "<end_of_turn>")}


class StopPool(ScriptedPool):
    """Scripted replies ending in `stop` (the turn terminator, not the EOS token), or cut at
    their token budget (no stop token) when `cut`."""

    def __init__(self, tokenizer, replies, stop: str, cut: bool = False):
        super().__init__(tokenizer, replies)
        self.stop, self.cut = tokenizer.convert_tokens_to_ids(stop), cut

    async def generate(self, request):
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        ids = ids if self.cut else [*ids, self.stop]
        out = Completion(token_ids=ids, logprobs=[-0.1] * len(ids), versions=[0] * len(ids),
                         finish_reason="length" if self.cut else "stop")
        self.requests.append(request)
        self.served.append(out)
        return out


def two_turns(ctx):
    """An agent's two calls: a question, then its reply sent back with a follow-up; the
    messages of the second call and its response."""
    messages = [{"role": "user", "content": "One."}]

    async def agent():
        client = ctx.openai_client()
        reply = await client.chat.completions.create(model="p", messages=messages)
        messages.extend([reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Two."}])
        return await client.chat.completions.create(model="p", messages=messages)

    return messages, asyncio.run(agent())


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("cut", [False, True], ids=["stopped", "cut-at-budget"])
def test_the_tokens_between_turns_are_what_the_template_renders_there(tokenizer, name, cut):
    template, specials, eos, stop = TEMPLATES[name]
    tok = with_template(tokenizer, template, specials, eos)
    assert tok.eos_token_id != tok.convert_tokens_to_ids(stop)
    pool = StopPool(tok, ["first", "second"], stop, cut=cut)
    ctx = context(tok, pool)
    messages, _ = two_turns(ctx)
    first, second = pool.requests
    one = pool.served[0]
    # the second prompt continues the model's own tokens ...
    assert list(second.input_ids[:len(first.input_ids) + len(one.token_ids)]) == \
        [*first.input_ids, *one.token_ids]
    # ... and reads exactly as the template renders the conversation
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.decode(second.input_ids) == rendered
    assert ctx.recorded_episode().info["openai"]["trained_calls"] == 2

    # the env and multi_turn workflows build the same tokens with chat_delta
    prompt = ctx.chat(messages[:1])
    delta = ctx.chat_delta([*messages[:1], {"role": "assistant", "content": "first"}],
                           messages[2:], completion=one)
    assert tok.decode([*prompt, *one.token_ids, *delta]) == rendered


# Qwen3's rule, reduced: past assistant turns lose their <think> block
THINK = ("{% for m in messages %}{% set c = m['content'] %}"
         "{% if m['role'] == 'assistant' and not loop.last %}"
         "{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
         "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_template_that_rewrites_past_turns_starts_a_new_sequence(tokenizer):
    tok = with_template(tokenizer, THINK, [], "<|im_end|>")
    pool = ScriptedPool(tok, ["<think>hmm</think>\nfirst", "second"])
    ctx = context(tok, pool)
    messages, last = two_turns(ctx)
    assert last.choices[0].message.content == "second"
    # the second prompt is the template's own rendering, as a server would build it
    assert list(pool.requests[1].input_ids) == ctx.chat(messages)
    episode = ctx.recorded_episode()
    assert episode.info["openai"] == {"calls": 2, "trained_calls": 1, "rewrote_history": False,
                                      "rerendered": 1}
    assert episode.token_ids == [*pool.requests[1].input_ids, *pool.served[1].token_ids]
    # a workflow that keeps its own context (multi_turn, env) goes on after the model's tokens
    delta = ctx.chat_delta([*messages[:1], {"role": "assistant", "content": "first"}],
                           messages[2:], completion=pool.served[0])
    assert tok.decode(delta) == "\n<|im_start|>user\nTwo.<|im_end|>\n<|im_start|>assistant\n"


def test_concurrent_episodes_share_one_http_server_which_close_stops(tokenizer, monkeypatch):
    import httpx
    import uvicorn

    started = []

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            started.append(self.servers[0].sockets[0].getsockname()[1])

    monkeypatch.setattr(uvicorn, "Server", Server)
    endpoint = OpenAIEndpoint()
    contexts = [context(tokenizer, None, endpoint) for _ in range(4)]

    async def main():
        urls = {access.base_url for access in await asyncio.gather(
            *(ctx.openai_server() for ctx in contexts))}
        await endpoint.close()
        return urls

    assert len(asyncio.run(main())) == 1
    assert len(started) == 1  # one server for all the episodes
    for port in started:  # and none listens after close
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def test_tools_a_template_does_not_render_are_warned_about_once(tokenizer, caplog, monkeypatch):
    from areal_flow.workflow import context as context_module

    monkeypatch.setattr(context_module, "_TOOLS_CHECKED", set())
    ctx = context(tokenizer, None)
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    with caplog.at_level("WARNING", logger="areal_flow.workflow.context"):
        ctx.chat(question, tools=TOOLS)
        ctx.chat(question, tools=TOOLS)
        ctx.chat(question)
    warned = [r.getMessage() for r in caplog.records if "does not render `tools`" in r.message]
    assert len(warned) == 1 and str(tokenizer.name_or_path) in warned[0]

    caplog.clear()  # a template that renders them is not warned about
    tools_template = ("{% if tools %}{{ 'Tools: ' + tools | tojson + '\n' }}{% endif %}" + CHATML)
    with caplog.at_level("WARNING", logger="areal_flow.workflow.context"):
        context(with_template(tokenizer, tools_template, [], "<|im_end|>"), None).chat(
            question, tools=TOOLS)
    assert not [r for r in caplog.records if "does not render `tools`" in r.message]


@workflow("tests.openai_question")
async def openai_question(ctx, sample):
    """An agent that asks one question through the endpoint (and lets errors propagate)."""
    client = ctx.openai_client()
    await client.chat.completions.create(model="p", messages=[
        {"role": "user", "content": sample["question"]}])
    episode = ctx.recorded_episode()
    episode.reward = float(sample["id"])
    return episode


def test_an_agents_prompt_over_the_budget_skips_the_sample_as_rlvr_does(tokenizer):
    from areal_flow.config import RolloutConfig
    from areal_flow.rollout.scheduler import RolloutScheduler

    async def unused(*args, **kwargs):
        raise AssertionError

    data = [{"id": 0, "question": "a very long question " * 20}, {"id": 1, "question": "Hi."}]
    with RolloutScheduler(
            pool=SeedPool(tokenizer), workflow="tests.openai_question", dataset=data,
            tokenizer=tokenizer, score=unused, sampling=SamplingParams(), shuffle=False,
            config=RolloutConfig(batch_size=1, group_size=2, max_concurrent=4, max_staleness=0,
                                 max_prompt_tokens=40)) as s:
        batch = s.prepare_batch(timeout=60)
        stats = s.stats()
    assert batch["sample_ids"].tolist() == [1, 1]
    assert stats["skipped_long_prompts"] >= 1
    assert "workflow_errors" not in stats and "failed_samples" not in stats
