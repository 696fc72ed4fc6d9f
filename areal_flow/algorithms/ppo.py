"""PPO with a learned critic, GAE and the decoupled (asynchronous) policy loss.

advantages (once per batch, before the update; V from the critic, r_t the row's reward on its
last model token, minus β·k_t on every model token when the KL penalty goes into the reward):
    δ_t = r_t + γ V_{t+1} − V_t,   A_t = δ_t + γλ A_{t+1},   R_t = A_t + V_t
    V_{T+1} = 0 (terminal), or V_T for a `truncated` row with `bootstrap_truncated`
    A ← (A − mean(A)) / std(A) over the batch's model tokens (optional)
actor loss per model token: the decoupled clipped surrogate shared with GRPO
    L = w · max(−ρA, −clip(ρ, 1 − ε_low, 1 + ε_high) A) [+ β·w ρ k3] − c_H·H_t
(the KL term is `F.kl_loss`, gradient β ∇KL(π_θ ‖ π_ref); w with the rollout/training
mismatch correction `loss.mismatch_correction`, `F.behavior_weight`, and `mismatch/...` stats)
critic loss per model token (V_old = the critic's values before the update):
    L_V = ½ max((V − R)², (V_old + clip(V − V_old, −ε_V, ε_V) − R)²)
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
class PPOConfig:
    """PPO options (defaults: γ = λ = 1, whitened advantages, no KL, value clip 0.2)."""

    loss: PolicyLossConfig = attrs.field(factory=PolicyLossConfig)
    gamma: float = attrs.field(default=1.0, validator=[v.ge(0.0), v.le(1.0)])
    """Discount per model token."""
    lam: float = attrs.field(default=1.0, validator=[v.ge(0.0), v.le(1.0)])
    """GAE lambda: 1 is Monte-Carlo returns minus V, 0 is one-step TD."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the batch's model tokens."""
    value_clip: float = attrs.field(default=0.2, validator=v.gt(0.0))
    """epsilon_V: how far the critic's value may move from V_old before the loss clips it."""
    kl_coef: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """beta of the KL penalty against the reference model; 0 needs no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = attrs.field(
        default="k1", validator=v.in_(tuple(F.KL_ESTIMATORS)))
    """KL estimator of the reward penalty (kl_in_reward): only k1's policy gradient is the
    reverse-KL gradient; k2, k3 are lower-variance values. The loss ignores it (F.kl_loss)."""
    kl_in_reward: bool = True
    """Subtract beta * KL per token from the reward (classic RLHF PPO) instead of the loss."""
    bootstrap_truncated: bool = False
    """Bootstrap rows the batch marks `truncated` (cut at the length limit) with V(T+1) := V_T,
    the critic's value at their last model token, instead of 0. Right when the cut is not part of
    the task (the row's reward is what it earned so far); wrong when the reward scores the cut
    answer (a wrong/missing answer, an overlong penalty): then the cut is the episode's end."""
    entropy_coef: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """Entropy bonus coefficient."""


@algorithm("ppo", config=PPOConfig)
class PPO:
    def __init__(self, config: PPOConfig | None = None):
        self.config = config or PPOConfig()
        c = self.config
        self.roles = F.roles(c.loss, "critic", *(("ref",) if c.kl_coef > 0 else ()))
        self.needs_entropy_grad = c.entropy_coef > 0
        self.skips_zero_advantage_rows = F.actor_loss_skips_zero_advantage(c)

    def advantages(self, batch):
        c = self.config
        mask = batch["loss_mask"]
        rewards = F.final_token_rewards(batch["rewards"], mask)
        if c.kl_coef > 0 and c.kl_in_reward:
            rewards = rewards - c.kl_coef * F.reference_kl(batch, c.kl_estimator, c.loss)
        values = F.masked(batch["values"], mask)
        last_values = None
        if c.bootstrap_truncated:
            if "truncated" not in batch.keys():
                raise ValueError("bootstrap_truncated needs the batch key 'truncated' ([rows] "
                                 "bool: finish_reason 'length')")
            # the critic's value after the last token is not kept: V_T stands in for V_{T+1}
            last = (mask.long() * torch.arange(mask.shape[1])).argmax(-1)
            last_values = torch.where(batch["truncated"] & mask.any(-1),
                                      values.gather(1, last[:, None])[:, 0], 0.0)
        advantages, returns = F.gae(rewards, values, mask, gamma=c.gamma, lam=c.lam,
                                    last_values=last_values)
        if c.whiten_advantages:
            advantages = F.whiten(advantages, mask)
        batch["advantages"] = advantages
        batch["returns"] = returns
        return batch

    def loss(self, out: ModelOutput, mb: MicroBatch) -> LossOutput:
        return F.actor_loss(out, mb, self.config)

    def critic_loss(self, out: ModelOutput, mb: MicroBatch) -> LossOutput:
        mask = mb.loss_mask
        old, returns = mb.values, mb.returns
        per_token = F.clipped_value_loss(out.values, old, returns, self.config.value_clip)
        n = mask.sum().clamp(min=1)
        moved = (out.values.detach() - old).abs() > self.config.value_clip
        stats = {
            "value_loss": per_token.detach().mul(mask).sum() / n,
            "value_mean": (out.values.detach() * mask).sum() / n,
            "return_mean": (returns * mask).sum() / n,
            "value_clip_fraction": (moved & mask).sum() / n,
        }
        return F.aggregate(per_token, mask, "token", stats)
