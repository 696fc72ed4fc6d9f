"""Episodes → a padded training batch (a TensorDict of B·G rows, groups kept together)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tensordict import NonTensorStack, TensorDict

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
    n, width = len(rows), max(ep.num_tokens for _, ep in rows)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.bool)
    loss_mask = torch.zeros((n, width), dtype=torch.bool)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    for i, (_, ep) in enumerate(rows):
        k = ep.num_tokens
        input_ids[i, :k] = torch.tensor(ep.token_ids, dtype=torch.long)
        attention_mask[i, :k] = True
        loss_mask[i, :k] = torch.tensor(ep.loss_mask, dtype=torch.bool)
        logprobs[i, :k] = torch.tensor(ep.logprobs, dtype=torch.float32)
        versions[i, :k] = torch.tensor(ep.versions, dtype=torch.long)
    names = sorted({name for _, ep in rows for name in ep.metrics})
    metrics = {name: torch.tensor([float(ep.metrics.get(name, math.nan)) for _, ep in rows])
               for name in names}
    return TensorDict(
        {
            # the task's numbers per row, NaN where an episode did not report one
            "metrics": TensorDict(metrics, batch_size=[n]),
            # free-form, for samples.jsonl; train() leaves it and `metrics` on rank 0
            "info": NonTensorStack(*(ep.info for _, ep in rows)),
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "logprobs": logprobs,
            "versions": versions,
            "rewards": torch.tensor([ep.reward for _, ep in rows], dtype=torch.float32),
            "group_ids": torch.tensor([gid for gid, _ in rows], dtype=torch.long),
            "truncated": torch.tensor([ep.truncated for _, ep in rows], dtype=torch.bool),
            # a prompt-only episode never sampled, so its logprobs are all masked; T=1 is neutral
            "temperature": torch.tensor(
                [ep.temperature or 1.0 for _, ep in rows], dtype=torch.float32
            ),
        },
        batch_size=[n],
    )
