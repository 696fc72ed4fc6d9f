"""GRPO with the decoupled (asynchronous) PPO objective.

advantages: A_i = group-relative reward (mean, or mean/std, or leave-one-out), the same for every
model token of row i; an optional KL penalty against the reference goes into the reward or the
loss.
loss per model token (π_θ current, π_prox the policy before this update, π_behav the policy that
generated the token):
    w = min(π_prox / π_behav, cap)                         (behavior correction, always applied)
    L = w · max(−ρA, −clip(ρ, 1 − ε_low, 1 + ε_high) A),  ρ = π_θ / π_prox   (+ dual clip)
      + β · KL(π_θ ‖ π_ref) − c_H · H(π_θ)
aggregated per token or per sequence (`PolicyLossConfig.aggregation`).

"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
from attrs import validators as v

from areal_flow.algorithms import algorithm
from areal_flow.algorithms import functional as F
from areal_flow.config import PolicyLossConfig
from areal_flow.types import LossOutput, ModelOutput


@attrs.frozen(kw_only=True)
class GRPOConfig:
    """GRPO options (defaults: GRPO with std normalisation, no KL, token-level loss)."""

    loss: PolicyLossConfig = attrs.field(factory=PolicyLossConfig)
    std_normalize: bool = True
    """Divide group-centred rewards by the group's std (off for Dr.GRPO)."""
    leave_one_out: bool = False
    """RLOO baseline: the mean of the other rows of the group."""
    kl_coef: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """beta of the KL penalty against the reference model; 0 needs no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = attrs.field(
        default="k3", validator=v.in_(tuple(F.KL_ESTIMATORS)))
    """KL estimator (k1, k2 or k3)."""
    kl_in_reward: bool = False
    """Subtract beta * KL (summed over the row) from the reward instead of adding it to the loss."""
    entropy_coef: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """Entropy bonus coefficient."""


@algorithm("grpo", config=GRPOConfig)
class GRPO:
    def __init__(self, config: GRPOConfig | None = None):
        self.config = config or GRPOConfig()
        self.roles = ("actor", "ref") if self.config.kl_coef > 0 else ("actor",)

    def advantages(self, batch):
        c = self.config
        mask = batch["loss_mask"]
        rewards = batch["rewards"].float()
        if c.kl_coef > 0 and c.kl_in_reward:
            kl = F.KL_ESTIMATORS[c.kl_estimator](batch["prox_logprobs"], batch["ref_logprobs"])
            rewards = rewards - c.kl_coef * (kl * mask).sum(-1)
        adv = F.group_advantages(rewards, batch["group_ids"], std_normalize=c.std_normalize,
                                 leave_one_out=c.leave_one_out)
        batch["advantages"] = adv[:, None] * mask
        return batch

    def loss(self, out: ModelOutput, mb) -> LossOutput:
        c, lc = self.config, self.config.loss
        mask = mb["loss_mask"]
        behav = mb["logprobs"]
        prox = mb.get("prox_logprobs", behav)
        weight, capped = F.importance_weight(prox, behav, lc.importance_weight_cap)
        surrogate, clipped = F.ppo_surrogate(
            out.logprobs, prox, mb["advantages"], eps_low=lc.eps_clip,
            eps_high=lc.eps_clip_high, dual_clip=lc.dual_clip)
        per_token = weight.detach() * surrogate
        if c.kl_coef > 0 and not c.kl_in_reward:
            per_token = per_token + c.kl_coef * F.KL_ESTIMATORS[c.kl_estimator](
                out.logprobs, mb["ref_logprobs"])
        if c.entropy_coef > 0 and out.entropy is not None:
            per_token = per_token + F.entropy_bonus(out.entropy, c.entropy_coef)
        loss_sum, normalizer, unit = F.AGGREGATIONS[lc.aggregation](per_token, mask)
        n = mask.sum().clamp(min=1)
        with torch.no_grad():
            stats = {
                "clip_fraction": (clipped & mask).sum() / n,
                "importance_weight_mean": (weight * mask).sum() / n,
                "importance_weight_max": (weight * mask).max(),
                "capped_fraction": (capped & mask).sum() / n,
                "approx_kl": ((behav - out.logprobs) * mask).sum() / n,
            }
            if out.entropy is not None:
                stats["entropy"] = (out.entropy * mask).sum() / n
        return LossOutput(loss_sum=loss_sum, normalizer=normalizer, unit=unit, stats=stats)
