"""Preference pairs (prompt, chosen, rejected) → DPO training rows.

Each pair becomes two chats with the same user turn, the prompt: one answered by the chosen
response, one by the rejected one (the chat template applied as for SFT,
`areal_flow.data.sft.tokenize_conversation`, so the trained tokens are the assistant's content
and its end-of-turn token). The two rows are one group, chosen first: `scatter_groups` gives a
group to one rank and `minibatch_of_rows` to one mini-batch, so the algorithm's `advantages`
and every optimizer step see both rows of a pair. (Micro-batches are cut by length alone and
may split a pair; `areal_flow.extra_algorithms.dpo` is written so that this does not matter.)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from tensordict import TensorDict

from areal_flow.data.collate import collate_groups
from areal_flow.data.sft import tokenize_conversation
from areal_flow.types import Episode


@attrs.frozen
class PreferencePair:
    """One comparison: `chosen` is preferred to `rejected` as an answer to `prompt`."""

    prompt: str
    chosen: str
    rejected: str


def pair_from_row(row: dict[str, Any], prompt_field: str = "prompt",
                  chosen_field: str = "chosen",
                  rejected_field: str = "rejected") -> PreferencePair:
    """A dataset row as a pair; a missing or non-text field is an error naming it."""
    fields = {"--prompt-field": prompt_field, "--chosen-field": chosen_field,
              "--rejected-field": rejected_field}
    missing = [name for name in fields.values() if name not in row]
    if missing:
        raise KeyError(f"a preference row needs the fields {list(fields.values())}; this one has "
                       f"no {missing} (it has {sorted(row)}): set "
                       f"{' / '.join(fields)} to the dataset's columns")
    for option, name in fields.items():
        if not isinstance(row[name], str):
            raise TypeError(f"field {name!r} ({option}) must be a string, not "
                            f"{type(row[name]).__name__}: pairs of whole conversations are not "
                            "supported; give the prompt and the two responses as text")
    return PreferencePair(row[prompt_field], row[chosen_field], row[rejected_field])


def tokenize_pair(tokenizer: Any, pair: PreferencePair) -> tuple[Episode, Episode]:
    """(chosen, rejected) episodes: the prompt as the user's turn, the response as the
    assistant's, trained on the assistant's tokens. Rewards 1 and 0 mark which is which."""
    chosen, rejected = (tokenize_conversation(tokenizer, [
        {"role": "user", "content": pair.prompt},
        {"role": "assistant", "content": response}]) for response in (pair.chosen, pair.rejected))
    chosen.reward, rejected.reward = 1.0, 0.0
    return chosen, rejected


def collate_pairs(tokenizer: Any, pairs: Sequence[PreferencePair]) -> TensorDict:
    """A batch of 2·len(pairs) rows: the keys of `collate_groups`, one group per pair (its chosen
    row first, the rejected row next to it), plus ``chosen`` ([rows] bool)."""
    batch = collate_groups([tokenize_pair(tokenizer, p) for p in pairs],
                           pad_token_id=tokenizer.pad_token_id or 0)
    batch["chosen"] = torch.arange(batch.batch_size[0]) % 2 == 0
    return batch


FINAL_ANSWER = re.compile(r"\n?#### *(-?[\d,.]+)\s*$")


def gsm8k_format_pairs(rows: Iterable[dict[str, Any]]) -> list[PreferencePair]:
    """Pairs that prefer GSM8K's answer format: the worked solution ending in '#### N' (the line
    the GSM8K reward reads) over the same solution ending in 'The answer is N.' instead. Rows
    whose answer does not end in '#### N' are left out."""
    pairs = []
    for row in rows:
        answer = str(row["answer"])
        match = FINAL_ANSWER.search(answer)
        if match:
            rejected = f"{answer[:match.start()]}\nThe answer is {match.group(1)}."
            pairs.append(PreferencePair(str(row["question"]), answer, rejected))
    return pairs
