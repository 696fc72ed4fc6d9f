"""Log-probabilities (and entropy) of the tokens a loss reads, and of no others.

The full-vocabulary head at every position is most of a small model's training memory, so it
runs only at the loss mask's positions, in chunks recomputed in backward, with log-softmax and
entropy written out in place (autograd's chain took 0.8 s of a 5.9 s bf16 step). It runs inside
the model's forward (`lm_head` swapped): only there does FSDP2 gather the tied embedding."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import attrs
import torch
import torch.nn.functional as F

from areal_flow.runtime.layout import PackedRows

EntropyMode = Literal["none", "metric", "grad"]
"""Entropy not at all; without gradient (a logged statistic); with gradient (an entropy term)."""

CHUNK_ELEMENTS = 2**25
"""Logits per chunk (128 MiB in fp32): 682 tokens of a 49,152-token vocabulary."""


@attrs.define
class LossPositions:
    """Where a batch's loss reads log-probs: position t (> 0) is token t given tokens < t."""

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
        column = torch.arange(loss_mask.shape[1], device=loss_mask.device)
        mask = loss_mask.bool() & (column > 0) & (column < layout.lengths[:, None])
        rows, cols = mask.nonzero(as_tuple=True)
        at = layout.index(rows, cols)
        return cls(rows=rows, cols=cols, states=at - 1, targets=layout.input_ids[0, at],
                   temperature=temperature.float()[rows])

    def scatter(self, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[rows, length]: `values` at these positions, 0 elsewhere (gradients flow through)."""
        return values.new_zeros(shape).index_put((self.rows, self.cols), values)


def token_stats(logits: torch.Tensor, temperature: torch.Tensor, targets: torch.Tensor,
                entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """[tokens] log-probs of `targets` under `logits` / `temperature` (fp32), entropies (if
    `entropy`) and log-normalisers. Consumes `logits` (in place, to bound temporaries)."""
    z = logits.float().div_(temperature[:, None])
    lse = torch.logsumexp(z, -1)
    token = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    # H = -sum p log p = lse - sum p z
    ent = lse - (z - lse[:, None]).exp_().mul_(z).sum(-1) if entropy else None
    return token, ent, lse


def logits_grad(logits: torch.Tensor, temperature: torch.Tensor, targets: torch.Tensor,
                lse: torch.Tensor, ent: torch.Tensor | None, g_token: torch.Tensor,
                g_ent: torch.Tensor | None) -> torch.Tensor:
    """The loss's gradient at `logits` from those at `token_stats`'s outputs: d log p_y / dz =
    onehot(y) - p, dH / dz = -p (log p + H). Consumes `logits`."""
    logp = logits.float().div_(temperature[:, None]).sub_(lse[:, None])
    p = logp.exp()
    g = p.mul_(-g_token[:, None]) if g_ent is None else \
        logp.add_(ent[:, None]).mul_(-g_ent[:, None]).sub_(g_token[:, None]).mul_(p)
    g.index_put_((torch.arange(len(targets), device=g.device), targets), g_token,
                 accumulate=True)
    return g.div_(temperature[:, None]).to(logits.dtype)


class _Head(torch.autograd.Function):
    """One chunk's log-probs (and entropies), its logits recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, entropy: bool):
        token, ent, lse = token_stats(F.linear(hidden, weight, bias), temperature, targets,
                                      entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, temperature, lse, ent)
        ctx.set_materialize_grads(False)
        return token, ent

    @staticmethod
    def backward(ctx, g_token, g_ent):
        hidden, weight, bias, targets, temperature, lse, ent = ctx.saved_tensors
        if g_token is None:
            g_token = torch.zeros_like(lse)
        g = logits_grad(F.linear(hidden, weight, bias), temperature, targets, lse, ent, g_token,
                        g_ent)
        needs = ctx.needs_input_grad
        return (g @ weight if needs[0] else None, g.t() @ hidden if needs[1] else None,
                g.sum(0) if bias is not None and needs[2] else None, None, None, None)


# a seam: benchmarks/train_step.py swaps in autograd's chain for its "- written-out head" row
def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           targets: torch.Tensor, temperature: torch.Tensor,
           entropy: EntropyMode) -> tuple[torch.Tensor, torch.Tensor | None]:
    token, ent = _Head.apply(hidden, weight, bias, targets, temperature, entropy != "none")
    if ent is not None and entropy != "grad":
        ent = ent.detach()
    return token, ent


def head_at_positions(head: torch.nn.Linear, hidden: torch.Tensor, where: LossPositions,
                      entropy: EntropyMode) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[positions] token log-probs (and entropies) of `head` on packed `hidden` [1, tokens,
    hidden] at `where`."""
    states = hidden.flatten(0, 1)[where.states]
    step = max(1, CHUNK_ELEMENTS // head.weight.shape[0])
    parts = [slice(start, start + step) for start in range(0, len(states), step)]
    if not parts:  # no loss position: still a graph through every layer, for FSDP's hooks
        empty = ((hidden.sum() + head.weight.sum()) * 0).float().expand(0)
        return empty, {"none": None, "metric": empty.detach(), "grad": empty}[entropy]
    tokens, entropies = zip(*(_chunk(states[p], head.weight, head.bias, where.targets[p],
                                     where.temperature[p], entropy) for p in parts))
    return torch.cat(tokens), (torch.cat(entropies) if entropy != "none" else None)


@contextlib.contextmanager
def loss_position_head(model: torch.nn.Module, where: LossPositions,
                       entropy: EntropyMode) -> Iterator[dict]:
    """Within the block `model(...).logits` is the [positions] log-probs at `where` ([positions,
    2] with entropy if `entropy == "grad"`); the yielded dict's "entropy" is the metric one."""
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
