"""`RolloutContext`: everything a `@workflow` function may touch while it builds one episode."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import logging

import attrs

from areal_flow.types import (Completion, Episode, GenerationPool, GenerationRequest,
                              SamplingParams, derived_seed)

if TYPE_CHECKING:  # the agents' part, loaded when an episode opens an OpenAI client or server
    from areal_flow.agents.openai_endpoint import OpenAIAccess, OpenAIEndpoint


log = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    """The chat prompt exceeds `max_prompt_tokens`; the scheduler skips the sample."""


# A private-use character pair no chat template or model text produces: it marks where the
# assistant's content sits in a rendered chat.
_TURN = "\ue000turn\ue000"


# not slotted: a judge keeps its counts on the context; identity equality, the default repr
@attrs.define(kw_only=True, slots=False, eq=False, repr=False)
class RolloutContext:
    """Passed to every workflow call; one per episode. Token-in/token-out: prompts are built as
    token ids once (`chat`, `chat_delta`, `encode`); completions keep the model's own tokens."""

    pool: GenerationPool
    tokenizer: Any
    _score: Callable[..., Any]  # the `score=` argument
    sampling: SamplingParams
    episode_id: str
    config: Any = None
    """The workflow's options (an instance of its declared config class), or None."""
    max_prompt_tokens: int | None = None
    seed: int | None = None
    """The n-th sampled `generate` call without a seed gets `derived_seed(seed, n)`, so a
    resumed run replays exactly what it would have sampled."""
    # `endpoint=`: the scheduler's, shared by its episodes (made when needed)
    _endpoint: Callable[[], OpenAIEndpoint] | None = None
    metrics: dict[str, float] = attrs.field(init=False, factory=dict)
    """The rewards' `metrics` of this episode (latest per name), added to the episode's."""
    rates: set[str] = attrs.field(init=False, factory=set)
    """Which of `metrics` are rates (`RewardSpec.rates`), added to the episode's `rates`."""
    over_budget: PromptTooLong | None = attrs.field(init=False, default=None)
    """A prompt the OpenAI endpoint refused as over `max_prompt_tokens`: skip the sample."""
    _calls: int = attrs.field(init=False, default=0)
    _app_made: OpenAIEndpoint | None = attrs.field(init=False, default=None)
    _recorder: Any = attrs.field(init=False, default=None)  # openai_endpoint.Recorder
    _key: str | None = attrs.field(init=False, default=None)

    def chat(self, messages: list[dict[str, Any]], *, tools: Any = None) -> list[int]:
        """The chat template applied to `messages` (and `tools`), ending with the assistant's
        turn opener; `PromptTooLong` past `max_prompt_tokens`."""
        ids = template_ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      **_tools(tools)))
        if tools is not None:
            _warn_if_tools_unrendered(self.tokenizer, messages, ids)
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise PromptTooLong(f"prompt of {len(ids)} tokens exceeds "
                                f"max_prompt_tokens={self.max_prompt_tokens}")
        return ids

    def chat_delta(self, history: list[dict[str, Any]], new: list[dict[str, Any]], *,
                   tools: Any = None, completion: Completion | None = None) -> list[int]:
        """Tokens the template renders after the model's turn `history[-1]` when `new` follow,
        through the next assistant opener, less the stop token that ended the turn (read from its
        tokens, `completion`, else the template's terminator), keeping the separator after it."""
        return self.tokens_after(self._around_turn(history, new, tools)[1], completion)

    def tokens_after(self, after: str, completion: Completion | None = None) -> list[int]:
        """`after` (from `turn_end`) tokenized, less the stop token `completion` ends with (else
        the special token `after` starts with)."""
        ids = completion.token_ids if completion is not None else self.encode(after)[:1]
        return self.encode(after.removeprefix(self._stop_text(ids)))

    def turn_end(self, history: list[dict[str, Any]], new: list[dict[str, Any]], *,
                 tools: Any = None) -> tuple[str, bool]:
        """The template's text after `history[-1]`'s content (an assistant turn) when `new`
        follow, through the next assistant opener; and whether it re-renders earlier turns
        unchanged (Qwen3's strips past `<think>`, so a chained prompt would differ)."""
        *before, reply = history
        prompt, after = self._around_turn(history, new, tools)
        unchanged = (prompt == self._render(before, tools) and
                     self._render([*history, *new], tools) == prompt + (reply["content"] or "")
                     + after)
        return after, unchanged

    def _around_turn(self, history: list[dict[str, Any]], new: list[dict[str, Any]],
                     tools: Any) -> tuple[str, str]:
        *before, reply = history
        marked = self._render([*before, {**reply, "content": _TURN}, *new], tools)
        prompt, found, after = marked.partition(_TURN)
        if not found:
            raise ValueError("the chat template does not render the assistant's content, so no "
                             "turn boundary can be found; build prompts with ctx.encode instead")
        return prompt, after

    def _render(self, messages: list[dict[str, Any]], tools: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **_tools(tools))

    def _stop_text(self, token_ids: Sequence[int]) -> str:
        """The text of the special tokens that end `token_ids` (the model's stop token)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        special = {*self.tokenizer.all_special_ids, *(i for i, t in added.items() if t.special)}
        k = len(token_ids)
        while k and token_ids[k - 1] in special:
            k -= 1
        return self.tokenizer.decode(list(token_ids[k:]), skip_special_tokens=False)

    def stop_at(self, completion: Completion, marker: str) -> Completion:
        """`completion` cut after the token that completes `marker` (finish reason "stop"), or
        unchanged without it; the kept tokens' logprobs stay exact."""
        decode, ids = self.tokenizer.decode, completion.token_ids
        if marker not in decode(ids):
            return completion
        # the shortest prefix whose text holds the marker
        lo = 1 + bisect.bisect(range(1, len(ids)), False, key=lambda n: marker in decode(ids[:n]))
        return attrs.evolve(completion, token_ids=ids[:lo], logprobs=completion.logprobs[:lo],
                            versions=completion.versions[:lo], finish_reason="stop",
                            text=decode(ids[:lo], skip_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Tokens of `text` without special tokens added (tool output, feedback)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def generate(self, prompt_ids: Sequence[int], **sampling: Any) -> Completion:
        """Continue `prompt_ids`; keyword arguments override this run's sampling settings."""
        params = attrs.evolve(self.sampling, **sampling) if sampling else self.sampling
        if params.seed is None and not params.greedy and self.seed is not None:
            params = attrs.evolve(params, seed=derived_seed(self.seed, self._calls))
        self._calls += 1
        request = GenerationRequest(input_ids=prompt_ids, sampling=params,
                                    episode_id=self.episode_id)
        return await self.pool.generate(request)

    async def reward(self, reward: Any, *args: Any, **kwargs: Any) -> float:
        """Score with a registered reward (name or function) in the reward runner; a hung,
        crashing or raising one scores its default. Its `metrics` go to `self.metrics` (rates to
        `self.rates`); invalid ones count as the reward's failure, never the workflow's."""
        from areal_flow.reward.runner import resolve, score_with_metrics

        score, metrics = await score_with_metrics(self._score, reward, *args, **kwargs)
        self.metrics.update(metrics)
        self.rates.update(name for name in resolve(reward).rates if name in metrics)
        return score

    async def judge(self, rubric: str, completion: str, *, question: str | None = None,
                    pool: GenerationPool | None = None, tokenizer: Any = None,
                    scale: tuple[float, float] = (0, 10), timeout: float = 30.0,
                    default: float = 0.0, **sampling: Any) -> float:
        """An LLM's grade of `completion` by `rubric` in [0, 1] (`areal_flow.judges.judge`): the
        judge (the policy's pool, or `pool`) is asked for ``Score: N``, N in `scale`; none, one out
        of range or no reply in `timeout` s scores `default`. Greedy unless `sampling` says; its
        tokens never enter the episode. `self.metrics` gets `judge_parsed` (etc.) fractions."""
        from areal_flow.judges.judge import Judge

        return await Judge(pool=pool, tokenizer=tokenizer, scale=scale, timeout=timeout,
                           default=default, sampling=sampling)(self, rubric, completion,
                                                               question=question)

    async def reward_model(self, messages_or_text: str | list[dict[str, Any]], *,
                           model: Any) -> float:
        """`model`'s score of messages or a text (a `RewardModel`, or a path loaded once)."""
        from areal_flow.judges.reward_model import RewardModel, load

        rm = model if isinstance(model, RewardModel) else load(model)
        return await rm.score(messages_or_text)

    def openai_client(self) -> Any:
        """An `openai.AsyncOpenAI` whose `chat.completions.create` generates with the pool and
        records each call's tokens for `recorded_episode()`. Needs ``areal-flow[agents]``."""
        import httpx

        try:
            import openai
        except ImportError:
            raise ModuleNotFoundError("ctx.openai_client() needs the openai package: pip install "
                                      "'areal-flow[agents]'", name="openai") from None
        return openai.AsyncOpenAI(
            api_key=self._register(), base_url="http://areal-flow.invalid/v1", max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=self._app().app)))

    async def openai_server(self) -> OpenAIAccess:
        """Base URL and key of an OpenAI-compatible HTTP endpoint for an agent in another
        process; its calls are recorded as `openai_client()`'s are."""
        from areal_flow.agents.openai_endpoint import OpenAIAccess

        return OpenAIAccess(await self._app().serve(), self._register())

    def recorded_episode(self, choice: int = 0) -> Episode:
        """The episode the OpenAI calls made, ending in choice `choice` of the last request; each
        earlier turn is the choice whose reply the agent sent back."""
        if self._recorder is None:
            raise ValueError("no OpenAI client or server was opened in this episode: use "
                             "ctx.openai_client() or await ctx.openai_server() first")
        return self._recorder.episode(choice)

    def close(self) -> None:
        """The episode is over: its key stops working (the scheduler calls this)."""
        if self._key is not None:
            self._app().release(self._key)

    def _app(self) -> OpenAIEndpoint:
        if self._app_made is None:
            from areal_flow.agents.openai_endpoint import OpenAIEndpoint

            self._app_made = (self._endpoint or OpenAIEndpoint)()  # the scheduler's, else its own
        return self._app_made

    def _register(self) -> str:
        if self._recorder is None:
            from areal_flow.agents.openai_endpoint import Recorder

            self._recorder = Recorder(self)
            self._key = self._app().register(self._recorder)
        return self._key

    def episode(self, prompt_ids: Sequence[int], completion: Completion | None = None, *,
                reward: float | None = None) -> Episode:
        """Start an episode: the prompt (not trained on), optionally a completion and a reward."""
        return Episode.start(prompt_ids, completion, reward=reward)


def field(sample: dict[str, Any], name: str) -> Any:
    """`sample[name]`, or an error naming the missing field and the fields the row has."""
    try:
        return sample[name]
    except (KeyError, TypeError):
        fields = ", ".join(map(str, sample)) if isinstance(sample, dict) else type(sample).__name__
        raise KeyError(f"dataset row has no field {name!r} (it has: {fields}); point the workflow "
                       "config at the right field") from None


def _tools(tools: Any) -> dict[str, Any]:
    return {} if tools is None else {"tools": tools}


_TOOLS_CHECKED: set[str] = set()  # templates already checked in this process


def _warn_if_tools_unrendered(tokenizer: Any, messages: list[dict[str, Any]],
                              ids: list[int]) -> None:
    """Warn once per template that renders the same prompt with and without `tools` (the tiny
    model's and SmolLM2's): the model is never shown them."""
    template = repr(tokenizer.chat_template)  # a string, or a dict of them
    if template in _TOOLS_CHECKED:
        return
    _TOOLS_CHECKED.add(template)
    if ids == template_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True)):
        log.warning("the chat template of %r does not render `tools`: the model is not shown "
                    "the tools it is given. Use a model whose template renders them, or put "
                    "their description in a system message",
                    getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def template_ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template; older versions a list
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]
