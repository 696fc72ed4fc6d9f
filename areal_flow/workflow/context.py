"""`RolloutContext`: everything a `@workflow` function may touch while it builds one episode."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from areal_flow.types import (Completion, Episode, GenerationPool, GenerationRequest,
                              SamplingParams, derived_seed)


class PromptTooLong(ValueError):
    """The chat prompt exceeds `max_prompt_tokens`; the scheduler skips the sample."""


class RolloutContext:
    """Passed to every workflow call; one context per episode.

    Token-in/token-out: prompts are built as token ids once (`chat`, `chat_delta`, `encode`), and
    completions are kept as the tokens the model produced, never re-tokenized from text.
    """

    def __init__(
        self,
        *,
        pool: GenerationPool,
        tokenizer: Any,
        score: Callable[..., Any],
        sampling: SamplingParams,
        episode_id: str,
        config: Any = None,
        max_prompt_tokens: int | None = None,
        seed: int | None = None,
    ):
        self.pool = pool
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.episode_id = episode_id
        self.config = config
        """The workflow's options (an instance of its declared config class), or None."""
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        """The episode's seed: its n-th sampled `generate` call without a seed of its own gets
        `derived_seed(seed, n)`, so a resumed run replays exactly what it would have sampled."""
        self._score = score
        self._calls = 0
        self.metrics: dict[str, float] = {}
        """What the rewards' `metrics` functions said about this episode (the latest call's value
        per name); the scheduler adds them to the episode's `metrics`."""

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template applied to `messages`, ending with the assistant's turn opener."""
        ids = _ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise PromptTooLong(
                f"prompt of {len(ids)} tokens exceeds max_prompt_tokens={self.max_prompt_tokens}"
            )
        return ids

    def chat_delta(self, history: list[dict[str, str]], new: list[dict[str, str]]) -> list[int]:
        """Tokens the chat template adds when the messages `new` follow `history`, whose last
        message is the assistant turn the model just produced (ending in its EOS token), up to
        and including the next assistant opener.

        Only the template's text after the model's EOS is tokenized; the model's own tokens stay
        as generated. Raises if the template renders earlier turns differently once more follow.
        """
        before = self.tokenizer.apply_chat_template(history, tokenize=False)
        after = self.tokenizer.apply_chat_template(
            [*history, *new], tokenize=False, add_generation_prompt=True
        )
        eos = self.tokenizer.eos_token
        cut = before.rfind(eos) if eos else -1
        prefix = before[: cut + len(eos)] if cut >= 0 else before  # the model stopped at its EOS
        if not after.startswith(prefix):
            raise ValueError(
                "this chat template renders earlier turns differently once more turns follow; "
                "build multi-turn prompts with ctx.encode instead"
            )
        return self.encode(after[len(prefix):])

    def stop_at(self, completion: Completion, marker: str) -> Completion:
        """`completion` cut right after the token whose text completes `marker` (finish reason
        "stop"), or unchanged when the marker does not occur. Dropped tokens never influenced
        the kept ones, so their logprobs stay exact."""
        decode = self.tokenizer.decode
        if marker not in decode(completion.token_ids):
            return completion
        lo, hi = 1, len(completion.token_ids)  # smallest prefix whose text holds the marker
        while lo < hi:
            mid = (lo + hi) // 2
            if marker in decode(completion.token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return attrs.evolve(
            completion,
            token_ids=completion.token_ids[:lo],
            logprobs=completion.logprobs[:lo],
            versions=completion.versions[:lo],
            finish_reason="stop",
            text=decode(completion.token_ids[:lo], skip_special_tokens=True),
        )

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
        """Score with a registered reward (name, or the decorated function) in the reward runner:
        a hung, crashing or raising reward scores its default. Its `metrics` function, if it
        declares one, records the task's numbers for this episode in `self.metrics`."""
        from areal_flow.reward.runner import resolve

        score = await self._score(reward, *args, **kwargs)
        spec = resolve(reward)
        if spec.metrics is not None:
            self.metrics.update(spec.metrics(*args, **kwargs))
        return score

    def episode(
        self,
        prompt_ids: Sequence[int],
        completion: Completion | None = None,
        *,
        reward: float | None = None,
    ) -> Episode:
        """Start an episode: the prompt (not trained on), optionally a completion and a reward."""
        return Episode.start(prompt_ids, completion, reward=reward)


def field(sample: dict[str, Any], name: str) -> Any:
    """`sample[name]`, or an error naming the missing field and the fields the row has."""
    try:
        return sample[name]
    except (KeyError, TypeError):
        fields = ", ".join(map(str, sample)) if isinstance(sample, dict) else type(sample).__name__
        raise KeyError(
            f"dataset row has no field {name!r} (it has: {fields}); point the workflow config "
            "at the right field"
        ) from None


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template; older versions a list
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]
