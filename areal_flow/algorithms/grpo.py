"""GRPO with the decoupled (asynchronous) PPO objective.

advantages: A_i = group-relative task reward (`F.group_advantages`) on every model token of row
i; with `kl_in_reward`, minus β (K_i − mean_g K), K_i = Σ_t k(log π_old, log π_ref)_t.
loss (`F.actor_loss`): decoupled PPO + β · `F.kl_loss` − c_H · H(π_θ), per token or sequence;
with `entropy_target`, c_H adapts each step (Skywork-OR1's adaptive entropy control)."""

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
    """KL estimator of the advantage's penalty (kl_in_reward; the loss uses F.kl_loss): only k1's
    policy gradient is the reverse-KL one; k2, k3 are lower-variance values."""
    kl_in_reward: bool = False
    """Put the KL penalty in the advantage, -beta * (K_i - mean_group K), not beta * F.kl_loss in
    the loss; a flat-reward group then learns from the KL alone."""
    entropy_coef: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """Entropy bonus coefficient (with `entropy_target`: its value at the first step)."""
    entropy_target: float | None = attrs.field(default=None,
                                               validator=v.optional(v.gt(0.0)))
    """Adaptive entropy control: the entropy (nats per token) to hold. Each step the coefficient
    moves by `entropy_coef_step`, up while the batch's entropy is below the target and down (to
    0 at least) while above, and the bonus applies only below it. A fixed coefficient either
    lets entropy collapse or makes it run away (benchmarks/results/reasoning_gym_search.md)."""
    entropy_coef_step: float = attrs.field(default=0.005, validator=v.gt(0.0))
    """How far `entropy_target`'s coefficient moves in one step."""


@algorithm("grpo", config=GRPOConfig)
class GRPO:
    min_group_size = 2  # a row is scored against the rest of its group: one alone never learns

    def __init__(self, config: GRPOConfig | None = None):
        self.config = c = config or GRPOConfig()
        self.roles = F.roles(c.loss, *(("ref",) if c.kl_coef > 0 else ()))
        self.needs_entropy_grad = c.entropy_coef > 0 or c.entropy_target is not None
        self.skips_zero_advantage_rows = (F.actor_loss_skips_zero_advantage(c)
                                          and c.entropy_target is None)
        self.entropy_coef = c.entropy_coef
        """`entropy_target`'s coefficient, as the last batch left it."""

    def advantages(self, batch):
        c = self.config
        mask, rewards, groups = batch["loss_mask"], batch["rewards"].float(), batch["group_ids"]
        adv = F.group_advantages(rewards, groups, std_normalize=c.std_normalize,
                                 leave_one_out=c.leave_one_out)
        if c.kl_coef > 0 and c.kl_in_reward:
            # centred in the group like the reward, but not divided by the reward's std: β means
            # the same whatever the group's reward spread (and as in the loss, next to A ~ 1)
            kl = F.reference_kl(batch, c.kl_estimator, c.loss)
            adv = adv - c.kl_coef * F.group_advantages(kl.sum(-1), groups, std_normalize=False,
                                                       leave_one_out=c.leave_one_out)
        batch["advantages"] = adv[:, None] * mask
        batch["flat_group"] = F.flat_groups(rewards, groups)
        if c.entropy_target is not None:  # a column: it reaches every rank with the rows
            batch["entropy_coef"] = torch.full(rewards.shape, self._adapt_entropy_coef(batch))
        return batch

    def _adapt_entropy_coef(self, batch) -> float:
        """The coefficient this batch trains with, after moving it by this batch's entropy:
        −mean log π_behav(token) over the model's tokens, a sample of the sampling policy's
        entropy (exact in expectation at the logprobs' temperature), measured without a pass."""
        c, mask = self.config, batch["loss_mask"]
        entropy = float(-(batch["logprobs"] * mask).sum() / mask.sum().clamp(min=1))
        below = entropy < c.entropy_target
        self.entropy_coef = max(0.0, self.entropy_coef + (c.entropy_coef_step if below
                                                          else -c.entropy_coef_step))
        applied = self.entropy_coef if below else 0.0
        # a step without the bonus needs no entropy gradient and skips flat rows (half the
        # work at half flat groups). Only this rank knows: the others keep __init__'s
        # conservative choice, which trains the same (their rows' coefficient is the column).
        self.needs_entropy_grad = applied > 0
        self.skips_zero_advantage_rows = applied == 0 and F.actor_loss_skips_zero_advantage(c)
        return applied

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the adaptive coefficient, which a resume continues from."""
        return {"entropy_coef": self.entropy_coef}

    def load_state_dict(self, state: dict) -> None:
        self.entropy_coef = float(state["entropy_coef"])

    def loss(self, out: ModelOutput, mb: MicroBatch) -> LossOutput:
        coef = None if self.config.entropy_target is None else \
            mb.columns["entropy_coef"].to(out.logprobs)[:, None]
        return F.actor_loss(out, mb, self.config, entropy_coef=coef)
