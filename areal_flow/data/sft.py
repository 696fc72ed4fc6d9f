"""Chat conversations → SFT training rows, trained on the assistant's tokens only.

Chat templates such as SmolLM2's have no generation markers, so the assistant's tokens are found
by incremental templating: for the i-th message, render the conversation up to it and take what
it adds to the rendering up to the previous message (for an assistant message: to the rendering
with the assistant opener, `add_generation_prompt=True`, so the opener is context, not target).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from areal_flow.data.collate import collate_groups
from areal_flow.types import Completion, Episode


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, str]]) -> Episode:
    """An episode whose trainable tokens are the assistant turns (content and end-of-turn)."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("an SFT conversation needs at least one assistant message: "
                         f"roles {[m.get('role') for m in messages]}")
    episode = Episode.start([], reward=0.0)
    rendered = ""
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            opener = _render(tokenizer, messages[:i], generation_prompt=True)
            episode.add_tokens(_encode(tokenizer, _extend(rendered, opener)))
            rendered = opener
            full = _render(tokenizer, messages[:i + 1])
            turn = _extend(rendered, full)
            # the model stops at its end-of-turn token: what the template adds after it (a
            # newline) is context for the next turn, never generated, so never trained on
            eos = tokenizer.eos_token
            cut = turn.rfind(eos) + len(eos) if eos and eos in turn else len(turn)
            ids = _encode(tokenizer, turn[:cut])
            episode.add(Completion(token_ids=ids, logprobs=[0.0] * len(ids),
                                   versions=[0] * len(ids), finish_reason="stop"))
            if turn[cut:]:
                episode.add_tokens(_encode(tokenizer, turn[cut:]))
        else:
            full = _render(tokenizer, messages[:i + 1])
            episode.add_tokens(_encode(tokenizer, _extend(rendered, full)))
        rendered = full
    return episode


def collate_sft(tokenizer: Any, conversations: Sequence[Sequence[dict[str, str]]]) -> TensorDict:
    """A training batch (the keys of `collate_groups`, one group per conversation)."""
    episodes = [tokenize_conversation(tokenizer, c) for c in conversations]
    return collate_groups([[ep] for ep in episodes], pad_token_id=tokenizer.pad_token_id or 0)


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], *,
            generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _extend(before: str, after: str) -> str:
    if not after.startswith(before):
        raise ValueError("this chat template renders earlier messages differently once more "
                         "follow, so assistant tokens cannot be found by incremental templating")
    return after[len(before):]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))
