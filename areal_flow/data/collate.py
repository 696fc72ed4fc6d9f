"""Episodes → a padded training batch (a TensorDict of B·G rows, groups kept together)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tensordict import NonTensorStack, TensorDict
from torch.nn.utils.rnn import pad_sequence

from areal_flow.types import Episode


def collate_groups(groups: Sequence[Sequence[Episode]], pad_token_id: int = 0) -> TensorDict:
    """Right-pad every episode to the longest; rows of a group are adjacent. Keys: ``input_ids``,
    ``attention_mask``, ``loss_mask`` (model tokens), ``logprobs`` (behavior; 0 elsewhere),
    ``versions`` (-1 elsewhere), ``rewards``, ``group_ids`` (index in `groups`), ``temperature``,
    ``truncated`` (last model turn hit its budget), ``metrics`` (NaN where missing), ``info``."""
    rows = [(gid, ep) for gid, group in enumerate(groups) for ep in group]
    if not rows:
        raise ValueError("cannot collate an empty batch")
    for gid, ep in rows:
        if ep.reward is None:
            raise ValueError(f"an episode of group {gid} has no reward; set ep.reward")
    n = len(rows)

    def padded(key: str, dtype: torch.dtype, pad: float) -> torch.Tensor:
        return pad_sequence([torch.tensor(getattr(ep, key), dtype=dtype) for _, ep in rows],
                            batch_first=True, padding_value=pad)

    lengths = torch.tensor([ep.num_tokens for _, ep in rows])
    metrics = {name: torch.tensor([float(ep.metrics.get(name, math.nan)) for _, ep in rows])
               for name in sorted({name for _, ep in rows for name in ep.metrics})}
    return TensorDict({
        # the task's numbers per row, NaN where an episode did not report one
        "metrics": TensorDict(metrics, batch_size=[n]),
        # free-form, for samples.jsonl; train() leaves it and `metrics` on rank 0
        "info": NonTensorStack(*(ep.info for _, ep in rows)),
        "input_ids": padded("token_ids", torch.long, pad_token_id),
        "attention_mask": torch.arange(int(lengths.max())) < lengths[:, None],
        "loss_mask": padded("loss_mask", torch.bool, False),
        "logprobs": padded("logprobs", torch.float32, 0.0),
        "versions": padded("versions", torch.long, -1),
        "rewards": torch.tensor([ep.reward for _, ep in rows], dtype=torch.float32),
        "group_ids": torch.tensor([gid for gid, _ in rows], dtype=torch.long),
        "truncated": torch.tensor([ep.truncated for _, ep in rows], dtype=torch.bool),
        # a prompt-only episode never sampled, so its logprobs are all masked; T=1 is neutral
        "temperature": torch.tensor([ep.temperature or 1.0 for _, ep in rows],
                                    dtype=torch.float32)}, batch_size=[n])
