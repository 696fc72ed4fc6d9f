"""`tiny-reverse`: a verifiers (v1) environment that runs offline, for the tests.

Reverse a word. The taskset is an in-memory word list; the task's rubric gives graded scores
(`chars`: the reversed word's letters found in the reply, over the longer of the two lengths;
`length`: how close the reply's length is to the word's) plus an exact-match bonus, so even a
tiny random model's groups differ. Its harness is an in-process chat loop (one model call
through the rollout's interception endpoint), which is what lets it run without the network:
verifiers' own harness programs install their dependencies with uv first, and stream.
"""

from collections import Counter

import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "grape",
         "ocean", "plant", "chair", "bread", "light", "sugar", "horse", "money"]


class ReverseData(vf.TaskData):
    answer: str = ""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def chars(self, trace: vf.Trace) -> float:
        reply, answer = trace.last_reply, self.data.answer
        shared = sum((Counter(reply) & Counter(answer)).values())
        return shared / max(len(reply), len(answer), 1)

    @vf.reward(weight=0.5)
    async def length(self, trace: vf.Trace) -> float:
        reply, answer = trace.last_reply, self.data.answer
        return 1 - abs(len(reply) - len(answer)) / max(len(reply), len(answer), 1)

    @vf.reward(weight=2.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = len(WORDS)


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        for word in WORDS[: self.config.num_tasks]:
            yield ReverseTask(ReverseData(prompt=f"Reverse the text: {word}",
                                          answer=word[::-1]), self.config.task)


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion, in process (verifiers allows a harness that runs its loop itself as
    long as every model call goes through `endpoint` with `secret`)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatHarness", "ReverseTaskset"]
