"""Log-probabilities (and entropy) of the tokens a loss reads, and of no others.

A causal LM's head over the whole vocabulary at every position is most of a small model's
training memory: one [rows, length, vocab] fp32 tensor of SmolLM2's 49,152 tokens is ~1 GB for
16 rows of 300 tokens, and log-softmax, exp and their gradients each make another. Most of those
positions are prompt tokens no loss reads. So the head runs only at the positions of the loss
mask, on the hidden states gathered there, in chunks of tokens; each chunk is recomputed in
backward (activation checkpointing) instead of keeping its logits, so at most one chunk's
[tokens, vocab] tensors exist at a time.

The head still runs inside the model's own forward (its `lm_head` is swapped for the duration of
one call): FSDP2 gathers the root module's parameters, the tied embedding included, only there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import attrs
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from areal_flow.runtime.layout import PackedRows

EntropyMode = Literal["none", "metric", "grad"]
"""Entropy not at all; without gradient (a logged statistic); with gradient (an entropy term)."""

CHUNK_ELEMENTS = 2**25
"""Logits per chunk (128 MiB in fp32): 682 tokens of a 49,152-token vocabulary."""


@attrs.define
class LossPositions:
    """Where a batch's loss reads log-probs: position t of a row is token t given tokens < t,
    computed from the hidden state at t - 1 (position 0 has no log-prob)."""

    rows: torch.Tensor
    cols: torch.Tensor
    """The padded [rows, length] coordinates of each position."""
    states: torch.Tensor
    """Where in the packed row (`layout.PackedRows`) the hidden state that predicts it is."""
    targets: torch.Tensor
    temperature: torch.Tensor
    """Per position: the row's sampling temperature."""

    @classmethod
    def of(cls, layout: PackedRows, loss_mask: torch.Tensor,
           temperature: torch.Tensor) -> LossPositions:
        mask = loss_mask.bool().clone()
        mask[:, 0] = False
        mask &= torch.arange(mask.shape[1], device=mask.device) < layout.lengths[:, None]
        rows, cols = mask.nonzero(as_tuple=True)
        at = layout.index(rows, cols)
        return cls(rows=rows, cols=cols, states=at - 1, targets=layout.input_ids[0, at],
                   temperature=temperature.float()[rows])

    def scatter(self, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[rows, length]: `values` at these positions, 0 elsewhere (gradients flow through)."""
        zeros = torch.zeros(shape, dtype=values.dtype, device=values.device)
        return zeros.index_put((self.rows, self.cols), values)


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           targets: torch.Tensor, temperature: torch.Tensor,
           entropy: EntropyMode) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp = torch.log_softmax(F.linear(hidden, weight, bias).float() / temperature[:, None], -1)
    token = logp.gather(-1, targets[:, None]).squeeze(-1)
    if entropy == "none":
        return token, None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        return token, -(logp.exp() * logp).sum(-1)


def head_at_positions(head: torch.nn.Linear, hidden: torch.Tensor, where: LossPositions,
                      entropy: EntropyMode) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[positions] token log-probs (and entropies) of `head` applied to the packed `hidden`
    [1, tokens, hidden] at `where`, chunked; checkpointed when gradients are on."""
    states = hidden.flatten(0, 1)[where.states]
    step = max(1, CHUNK_ELEMENTS // head.weight.shape[0])
    tokens, entropies = [], []
    for start in range(0, len(states), step):
        part = slice(start, start + step)
        args = (states[part], head.weight, head.bias, where.targets[part],
                where.temperature[part], entropy)
        token, ent = checkpoint(_chunk, *args, use_reentrant=False) \
            if torch.is_grad_enabled() else _chunk(*args)
        tokens.append(token)
        entropies.append(ent)
    if not tokens:  # no loss position: still a graph through every layer, for FSDP's hooks
        empty = ((hidden.sum() + head.weight.sum()) * 0).float().expand(0)
        return empty, {"none": None, "metric": empty.detach(), "grad": empty}[entropy]
    return torch.cat(tokens), (torch.cat(entropies) if entropy != "none" else None)


@contextlib.contextmanager
def loss_position_head(model: torch.nn.Module, where: LossPositions,
                       entropy: EntropyMode) -> Iterator[dict]:
    """Within the block, `model(...)` returns as `.logits` the [positions] token log-probs of
    `where` (or [positions, 2] with the entropy when `entropy == "grad"`), and the returned dict
    gets the no-gradient entropy under "entropy" when `entropy == "metric"`."""
    head = model.get_output_embeddings()
    extra: dict = {}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        token, ent = head_at_positions(head, hidden, where, entropy)
        if entropy == "grad":
            return torch.stack([token, ent], -1)
        extra["entropy"] = ent
        return token  # the tensor FSDP2 hooks for backward must be the one the loss uses

    head.forward = forward
    try:
        yield extra
    finally:
        del head.forward  # the class's forward again
