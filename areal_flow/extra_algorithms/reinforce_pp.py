"""REINFORCE++ (Hu et al. 2025; OpenRLHF's `reinforce` and `reinforce_baseline` estimators):
no critic, per-token returns of the task reward and a KL penalty, normalised over the batch.

advantages (once per batch; π_old = π_prox when recomputed, else π_behav; T = the row's last
model token; the steps s are the row's model tokens, in order):
    r̂_i = r_i (baseline "none"),  or  r_i − mean_g(r) (baseline "group_mean", a flat group: 0)
    r_t = r̂_i·[t = T] − β·k(log π_old, log π_ref)_t                 (k = kl_estimator, k1)
    G_t = Σ_{s≥t} γ^{s−t} r_s                              (`F.gae` with V = 0, λ = 1)
    A_t = (G_t − mean(G)) / (std(G) + ε) over all model tokens of the batch (`F.whiten`);
          A = 0 when every G_t of the batch is equal
loss per model token: the decoupled clipped surrogate shared with GRPO and PPO
    L_t = w_t · max(−ρ_t A_t, −clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t),
    ρ_t = π_θ / π_prox,  w_t = min(π_prox / π_behav, cap)  (no gradient)
aggregated per token by default (`PolicyLossConfig.aggregation`).
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
from attrs import validators as v

from areal_flow.algorithms import algorithm
from areal_flow.algorithms import functional as F
from areal_flow.config import PolicyLossConfig
from areal_flow.types import LossOutput, MicroBatch, ModelOutput


@attrs.frozen(kw_only=True)
class ReinforcePPConfig:
    """REINFORCE++ options (defaults: β = 0.01 with k1, γ = 1, no baseline, token-level loss)."""

    loss: PolicyLossConfig = attrs.field(factory=PolicyLossConfig,
                                         validator=v.instance_of(PolicyLossConfig))
    """The clipped, decoupled policy loss (eps_clip, importance_weight_cap, aggregation, ...)."""
    kl_coef: float = attrs.field(default=0.01, validator=v.ge(0.0))
    """beta of the per-token KL penalty in the reward; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = attrs.field(
        default="k1", validator=v.in_(tuple(F.KL_ESTIMATORS)))
    """KL estimator of the penalty: only k1's policy gradient is the reverse-KL gradient."""
    gamma: float = attrs.field(default=1.0, validator=[v.ge(0.0), v.le(1.0)])
    """Discount per model token of the return."""
    baseline: Literal["none", "group_mean"] = attrs.field(
        default="none", validator=v.in_(("none", "group_mean")))
    """"group_mean" (REINFORCE++-baseline) subtracts the group's mean task reward before the KL
    penalty is added; it needs --rollout.group-size 2 or more."""


@algorithm("reinforce_pp", config=ReinforcePPConfig)
class ReinforcePP:
    needs_entropy_grad = False
    skips_zero_advantage_rows = True  # every term of the loss is multiplied by A_t

    def __init__(self, config: ReinforcePPConfig | None = None):
        self.config = c = config or ReinforcePPConfig()
        self.roles = F.roles(c.loss, *(("ref",) if c.kl_coef > 0 else ()))
        self.min_group_size = 2 if c.baseline == "group_mean" else 1

    def advantages(self, batch):
        c = self.config
        mask, rewards = batch["loss_mask"], batch["rewards"].float()
        if c.baseline == "group_mean":
            rewards = F.group_advantages(rewards, batch["group_ids"], std_normalize=False)
        per_token = F.final_token_rewards(rewards, mask)
        if c.kl_coef > 0:
            per_token = per_token - c.kl_coef * F.reference_kl(batch, c.kl_estimator, c.loss)
        returns, _ = F.gae(per_token, torch.zeros(mask.shape), mask, gamma=c.gamma, lam=1.0)
        live = returns[mask]
        flat = live.numel() == 0 or bool(live.max() == live.min())  # rounding, not signal
        batch["advantages"] = torch.zeros(mask.shape) if flat else F.whiten(returns, mask)
        batch["returns"] = returns
        return batch

    def loss(self, out: ModelOutput, mb: MicroBatch) -> LossOutput:
        c, mask = self.config, mb.loss_mask
        per_token, stats = F.decoupled_policy_loss(out.logprobs, mb, c.loss)
        if c.kl_coef > 0:  # k(π_θ, π_ref) on the sampled tokens, per token
            kl = F.KL_ESTIMATORS[c.kl_estimator](F.masked(out.logprobs.detach(), mask),
                                                 F.masked(mb.ref_logprobs, mask))
            stats["kl_ref"] = F.masked(kl, mask).sum() / mask.sum().clamp(min=1)
        return F.aggregate(per_token, mask, c.loss.aggregation, stats)
