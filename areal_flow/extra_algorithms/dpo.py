"""Direct Preference Optimization on offline pairs (Rafailov et al. 2023), and IPO (Azar et al.
2023) with the same inputs.

For a pair (y_w chosen, y_l rejected) answering x, with sequence log-probabilities
s(y) = Σ_t log π(y_t | x, y_<t) over the response's tokens (the rows' `loss_mask`):

    h(y)  = s_θ(y) − s_ref(y)                          the implicit reward is β·h(y)
    d     = h(y_w) − h(y_l),   z = β·d
    sigmoid:  L = −(1 − ε) log σ(z) − ε log σ(−z)     (ε = label_smoothing)
    ipo:      L = (d − 1/(2β))² = (z/β − 1/(2β))²      (IPO's sampled loss, eq. 17: sums, as
                                                        for the sigmoid loss; TRL divides s by
                                                        the number of tokens instead)

averaged over the pairs of the batch. Data: `areal_flow.extra_algorithms.preference.collate_pairs` (one
group of two rows per pair, chosen first, a ``chosen`` [rows] key).

Micro-batches may split a pair. The runtime keeps a group on one rank and in one mini-batch,
but cuts micro-batches by row length alone (`runtime.microbatch.micro_batches`, first-fit
decreasing), so the chosen row can be in one forward/backward and the rejected row in another.
L is not a sum of per-row terms, so the loss needs the partner's log-ratio too. Hence the
``actor`` role: the runtime's forward pass before the update gives s_prox for every row, and
`advantages` (which sees whole groups) stores each row's partner's h_prox. In a micro-batch:

    both rows present:  L(β(h_w − h_l))                   both with gradient
    chosen row alone:   L(β(h_w − h_prox(y_l)))           gradient through h_w
    rejected row alone: L(β(h_prox(y_w) − h_l)) − (the same, detached)
                        value 0 (the pair's loss is counted once, with its chosen row),
                        gradient through h_l

On the first (by default the only, `--train.ppo-minibatches 1`) optimizer step of a batch the
weights are those of the forward pass, h_prox = h_θ, so the step's loss and gradient are exactly
those of the pairs' DPO loss however the rows were split (`tests/test_dpo.py` checks both, and
the runtime's steps with and without splits). On later mini-batches a split pair's partner term
is the pre-update value, one or more steps stale; unsplit pairs stay exact.

Metrics (from the forward pass before the update, the whole batch): ``rewards/chosen`` and
``rewards/rejected`` (mean β·h), ``rewards/margin`` (mean β·d), ``rewards/accuracy`` (fraction
of pairs with d > 0).
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
from attrs import validators as v

from areal_flow.algorithms import algorithm
from areal_flow.algorithms import functional as F
from areal_flow.types import LossOutput, MicroBatch, ModelOutput

Tensor = torch.Tensor


def sigmoid_loss(d: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """−(1 − ε) log σ(βd) − ε log σ(−βd), per pair (softplus(−x) = −log σ(x), stable)."""
    z = beta * d
    return (1 - label_smoothing) * torch.nn.functional.softplus(-z) \
        + label_smoothing * torch.nn.functional.softplus(z)


def ipo_loss(d: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """(d − 1/(2β))², per pair (label smoothing does not apply)."""
    return (d - 1 / (2 * beta)) ** 2


LOSSES = {"sigmoid": sigmoid_loss, "ipo": ipo_loss}
"""The per-pair loss of d = h(y_w) − h(y_l), by `DPOConfig.loss_type`."""


@attrs.frozen(kw_only=True)
class DPOConfig:
    """DPO options (default: the sigmoid loss of the DPO paper at β = 0.1)."""

    beta: float = attrs.field(default=0.1, validator=v.gt(0.0))
    """β: the strength of the implicit KL constraint to the reference model (IPO's τ)."""
    label_smoothing: float = attrs.field(default=0.0, validator=[v.ge(0.0), v.lt(0.5)])
    """ε: the probability that a pair's preference label is flipped (conservative DPO); sigmoid
    loss only."""
    loss_type: Literal["sigmoid", "ipo"] = attrs.field(default="sigmoid",
                                                        validator=v.in_(tuple(LOSSES)))
    """sigmoid: −log σ(β·d) (DPO); ipo: (d − 1/(2β))² (IPO)."""

    def __attrs_post_init__(self) -> None:
        if self.label_smoothing and LOSSES[self.loss_type] is not sigmoid_loss:
            raise ValueError(f"label_smoothing applies to the sigmoid loss only, not "
                             f"{self.loss_type!r}: leave it at 0")


def sequence_logratio(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[rows] h = Σ_t (log π − log π_ref) over each row's masked tokens (pads hold anything)."""
    return F.masked(logprobs, mask).sum(-1) - F.masked(ref_logprobs, mask).float().sum(-1)


def partners(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """([rows] index of the other row of each row's group, [rows] whether it is present)."""
    same = group_ids[:, None] == group_ids[None, :]
    same &= ~torch.eye(len(group_ids), dtype=torch.bool, device=group_ids.device)
    return same.float().argmax(-1), same.any(-1)


def check_pairs(group_ids: Tensor, chosen: Tensor) -> None:
    """Every group is one chosen and one rejected row, or a ValueError naming a group."""
    same = group_ids[:, None] == group_ids[None, :]
    rows, chosen_rows = same.sum(-1), (same & chosen[None, :]).sum(-1)
    bad = ((rows != 2) | (chosen_rows != 1)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"DPO needs every group to be one chosen and one rejected row "
                         f"(areal_flow.extra_algorithms.preference.collate_pairs); group "
                         f"{int(group_ids[i])} has {int(rows[i])} row(s), "
                         f"{int(chosen_rows[i])} chosen")


@algorithm("dpo", config=DPOConfig)
class DPO:
    roles = ("actor", "ref")  # ref: π_ref; actor: h_prox of the partner of a split pair

    def __init__(self, config: DPOConfig | None = None):
        self.config = config or DPOConfig()
        self.pair_loss = LOSSES[self.config.loss_type]

    def advantages(self, batch):
        """Stores ``dpo_partner`` (the partner row's h_prox) and the batch's reward metrics on
        every row (each micro-batch then reports the batch's values)."""
        if "chosen" not in batch.keys():
            raise ValueError("DPO trains on preference pairs, batches of "
                             "areal_flow.extra_algorithms.preference.collate_pairs (recipes/dpo.py): this "
                             "batch has no 'chosen' key")
        chosen = batch["chosen"].bool()
        check_pairs(batch["group_ids"], chosen)
        h = sequence_logratio(batch["prox_logprobs"], batch["ref_logprobs"], batch["loss_mask"])
        index, _ = partners(batch["group_ids"])
        batch["dpo_partner"] = h[index]
        beta, rows = self.config.beta, batch.batch_size[0]
        reward_w, reward_l = beta * h[chosen], beta * h[index][chosen]
        for key, value in {"chosen": reward_w.mean(), "rejected": reward_l.mean(),
                           "margin": (reward_w - reward_l).mean(),
                           "accuracy": (reward_w > reward_l).float().mean()}.items():
            batch[f"dpo_rewards_{key}"] = value.expand(rows).clone()
        return batch

    def loss(self, out: ModelOutput, mb: MicroBatch) -> LossOutput:
        """The pairs' loss whose chosen row is in `mb`, with the gradient of every row of `mb`
        (see the module's docstring for a pair split between micro-batches)."""
        chosen = mb.columns["chosen"].bool()
        h = sequence_logratio(out.logprobs, mb.ref_logprobs, mb.loss_mask)
        index, present = partners(mb.group_ids)
        partner = torch.where(present, h[index], mb.columns["dpo_partner"].to(h.dtype))
        d = torch.where(chosen, h - partner, partner - h)
        per_pair = self.pair_loss(d, self.config.beta, self.config.label_smoothing)
        # the rejected row of a whole pair adds nothing (its chosen row's term has both), and
        # a rejected row alone adds its gradient with value 0
        zero = torch.zeros_like(per_pair)
        per_row = torch.where(chosen, per_pair,
                              torch.where(present, zero, per_pair - per_pair.detach()))
        stats = {f"rewards/{key}": mb.columns[f"dpo_rewards_{key}"].float().mean()
                 for key in ("chosen", "rejected", "margin", "accuracy")}
        return LossOutput(loss_sum=per_row.sum(), normalizer=float(chosen.sum()),
                          unit="sequences", stats=stats)
