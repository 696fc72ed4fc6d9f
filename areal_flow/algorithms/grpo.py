"""GRPO with the decoupled (asynchronous) PPO objective.

advantages: A_i = group-relative task reward (mean, or mean/std, or leave-one-out), the same for
every model token of row i; an optional KL penalty against the reference goes into the loss or
the advantage (never through the task reward's std, nor hiding a flat group):
    kl_in_reward:  A_i = Â_g(r)_i − β (K_i − mean_g K),   K_i = Σ_t k(log π_old, log π_ref)_t
loss per model token (π_θ current, π_prox the policy before this update, π_behav the policy that
generated the token):
    w = min(π_prox / π_behav, cap)                         (behavior correction, always applied;
        `PolicyLossConfig.mismatch_correction` changes it on tokens of the trained version: TIS
        min(π_train / π_rollout, C) or a mask, see `F.behavior_weight`; `mismatch/...` stats)
    L = w · max(−ρA, −clip(ρ, 1 − ε_low, 1 + ε_high) A),  ρ = π_θ / π_prox   (+ dual clip)
      + β · w ρ k3 − c_H · H(π_θ)            (KL term `F.kl_loss`: gradient β ∇KL(π_θ ‖ π_ref))
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
        default="k1", validator=v.in_(tuple(F.KL_ESTIMATORS)))
    """KL estimator of the penalty in the advantage (kl_in_reward): only k1's policy gradient is
    the reverse-KL gradient; k2, k3 are lower-variance values. The loss ignores it (F.kl_loss)."""
    kl_in_reward: bool = False
    """Put the KL penalty in the advantage, -beta * (K_i - mean_group K) with K_i the row's summed
    per-token KL, instead of beta * F.kl_loss in the loss. A flat-reward group then learns from
    the KL alone; `flat_group` marks it either way."""
    entropy_coef: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """Entropy bonus coefficient."""


@algorithm("grpo", config=GRPOConfig)
class GRPO:
    min_group_size = 2  # a row is scored against the rest of its group: one alone never learns

    def __init__(self, config: GRPOConfig | None = None):
        self.config = config or GRPOConfig()
        c = self.config
        self.roles = F.roles(c.loss, *(("ref",) if c.kl_coef > 0 else ()))
        self.needs_entropy_grad = c.entropy_coef > 0
        self.skips_zero_advantage_rows = F.actor_loss_skips_zero_advantage(c)

    def advantages(self, batch):
        c = self.config
        mask, rewards, groups = batch["loss_mask"], batch["rewards"].float(), batch["group_ids"]
        adv = F.group_advantages(rewards, groups, std_normalize=c.std_normalize,
                                 leave_one_out=c.leave_one_out)
        if c.kl_coef > 0 and c.kl_in_reward:
            # centred in the group like the reward, but not divided by the reward's std: β means
            # the same whatever the group's reward spread (and as in the loss, next to A ~ 1)
            kl = F.reference_kl(batch, c.kl_estimator)
            adv = adv - c.kl_coef * F.group_advantages(kl.sum(-1), groups, std_normalize=False,
                                                       leave_one_out=c.leave_one_out)
        batch["advantages"] = adv[:, None] * mask
        batch["flat_group"] = F.flat_groups(rewards, groups)
        return batch

    def loss(self, out: ModelOutput, mb) -> LossOutput:
        return F.actor_loss(out, mb, self.config)
