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
        self.roles = (("actor",) if self.config.loss.recompute_proximal else ()) + \
            (("ref",) if self.config.kl_coef > 0 else ())

    def advantages(self, batch):
        c = self.config
        mask = batch["loss_mask"]
        rewards = batch["rewards"].float()
        if c.kl_coef > 0 and c.kl_in_reward:
            old = batch["prox_logprobs"] if "prox_logprobs" in batch.keys() else batch["logprobs"]
            kl = F.KL_ESTIMATORS[c.kl_estimator](old, batch["ref_logprobs"])
            rewards = rewards - c.kl_coef * (kl * mask).sum(-1)
        adv = F.group_advantages(rewards, batch["group_ids"], std_normalize=c.std_normalize,
                                 leave_one_out=c.leave_one_out)
        batch["advantages"] = adv[:, None] * mask
        return batch

    def loss(self, out: ModelOutput, mb) -> LossOutput:
        return F.actor_loss(out, mb, self.config)
