"""On-policy distillation: the student samples, a frozen teacher scores the student's own tokens,
and the student is trained to lower the reverse KL, KL(π_θ ‖ π_teacher), on its samples
(Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD); Thinking Machines 2025,
"On-Policy Distillation"). The teacher is the runtime's `teacher` role (`teacher_logprobs`): a
frozen model of the same tokenizer, loaded by the recipes from `--teacher PATH`.

advantages (once per batch, no gradient), on each model token t of row i:
    k_t = log π_old(y_t) − log π_teacher(y_t)       (k1: the per-token reverse-KL estimate)
    A_t = −Σ_{s ≥ t} γ^{s−t} k_s  [+ task_weight · Â_g(r)_i]
        γ = `kl_discount` (0: A_t = −k_t, Thinking Machines' form; 1: the sequence's KL to go);
        Â_g(r) the group-normalised task reward (GRPO's); π_old = π_prox (recomputed: the `actor`
        role) or π_behav (`--algorithm.loss.no-recompute-proximal`)
loss per token: GRPO's decoupled PPO loss with these advantages
    L_t = w · max(−ρA_t, −clip(ρ, 1 − ε_low, 1 + ε_high) A_t),  ρ = π_θ/π_prox,  w = min(π_prox/π_behav, cap)

Why the KL estimate is an advantage (a reward, without gradient) and not a loss: on tokens
y ~ π_θ, differentiating the estimate itself, ∇(log π_θ(y) − log π_teacher(y)) = ∇log π_θ(y),
averages to E_π[∇log π_θ] = 0, whatever the teacher (k1's pitfall, docs/algorithms.md "KL
against the reference"); the policy gradient of −k instead is
    E_π[k_t ∇log π_θ(y_t)] = E_π[(log π_θ − log π_teacher) ∇log π_θ] = ∇KL(π_θ ‖ π_teacher)
per position (context held fixed) at ρ = 1 for γ = 0, and with γ = 1 the score-function gradient
of the whole sequence's reverse KL, contexts included (earlier k_s, s < t, are independent of y_t's
score and drop out). The one direct loss with that gradient is `F.kl_loss` (w ρ k3, the same
per-sample gradient as γ = 0 at ρ = 1): the advantage form adds the clipped trust region for stale
tokens and later mini-batches, the task reward on the same scale, and γ > 0.

Both log-probs are at the episode's sampling temperature (the runtime scores the teacher at each
row's temperature): the target is the teacher's distribution at that temperature, the teacher
itself at T = 1.
"""

from __future__ import annotations

import attrs
import torch
from attrs import validators as v

from areal_flow.algorithms import algorithm
from areal_flow.algorithms import functional as F
from areal_flow.config import PolicyLossConfig
from areal_flow.types import LossOutput, MicroBatch, ModelOutput


@attrs.frozen(kw_only=True)
class DistillConfig:
    """On-policy distillation options (defaults: pure distillation, per-token advantages)."""

    loss: PolicyLossConfig = attrs.field(factory=PolicyLossConfig)
    """The clipped policy loss (as GRPO's). With recompute_proximal (the default) the student's
    logprobs in the KL estimate are recomputed by the trainer, like the teacher's; without it
    they are the sampler's."""
    task_weight: float = attrs.field(default=0.0, validator=v.ge(0.0))
    """Weight of the group-normalised task reward (GRPO's advantage) added to every token's
    distillation advantage; > 0 needs groups of 2 or more (--rollout.group-size)."""
    kl_discount: float = attrs.field(default=0.0, validator=[v.ge(0.0), v.le(1.0)])
    """γ: a token's advantage is −Σ_{s≥t} γ^(s−t) k_s over the row's later model tokens. 0: its
    own KL only (Thinking Machines); 1: the KL of the rest of the sequence (the exact gradient of
    the sequence-level reverse KL, higher variance)."""


@algorithm("distill", config=DistillConfig)
class OnPolicyDistillation:
    skips_zero_advantage_rows = True  # every term of the loss is multiplied by A

    def __init__(self, config: DistillConfig | None = None):
        self.config = config or DistillConfig()
        self.roles = F.roles(self.config.loss, "teacher")
        # the task reward is scored against the rest of the group; alone, it would be 0
        self.min_group_size = 2 if self.config.task_weight > 0 else 1

    def advantages(self, batch):
        c = self.config
        mask = batch["loss_mask"]
        kl = F.masked(F.old_logprobs(batch, c.loss), mask) \
            - F.masked(batch["teacher_logprobs"], mask)
        # −Σ_{s≥t} γ^(s−t) k_s over the row's later model tokens: GAE with V = 0 and λ = 1
        adv = -F.gae(kl, torch.zeros_like(kl), mask, gamma=c.kl_discount)[0]
        if c.task_weight > 0:
            task = F.group_advantages(batch["rewards"].float(), batch["group_ids"])
            adv = adv + c.task_weight * task[:, None] * mask
        batch["advantages"] = adv
        return batch

    def loss(self, out: ModelOutput, mb: MicroBatch) -> LossOutput:
        mask = mb.loss_mask
        per_token, stats = F.decoupled_policy_loss(out.logprobs, mb, self.config.loss)
        with torch.no_grad():
            # KL(π_θ ‖ π_teacher) per token: k1 of the weights being trained, on tokens sampled
            # by π_behav, importance-weighted by w·ρ = π_θ/π_behav (w capped as in the loss)
            logp = F.masked(out.logprobs, mask)
            behav, prox = F.behavior_and_proximal(logp, mb, self.config.loss)
            weight, _ = F.importance_weight(prox, behav, self.config.loss.importance_weight_cap)
            kl = weight * torch.exp(logp - prox) * (logp - F.masked(mb.teacher_logprobs, mask))
            stats["distill/reverse_kl"] = F.masked(kl, mask).sum() / mask.sum().clamp(min=1)
        return F.aggregate(per_token, mask, self.config.loss.aggregation, stats)


def check_teacher(teacher: str, model: str) -> None:
    """--teacher has --model's tokenizer (every token to the same id) and embeds all its ids; a
    larger embedding is fine (Qwen2.5-7B pads 152064 rows, 0.5B 151936, for 151665 tokens)."""
    from transformers import AutoConfig, AutoTokenizer

    where = {}
    for option, name in (("--teacher", teacher), ("--model", model)):
        try:
            where[option] = (AutoConfig.from_pretrained(name), AutoTokenizer.from_pretrained(name))
        except (OSError, ValueError) as error:
            raise ValueError(f"{option} {name}: no model config and tokenizer to check the "
                             f"teacher against the student ({error})") from None
    (t_config, t_tok), (s_config, s_tok) = where["--teacher"], where["--model"]
    t_vocab, s_vocab = t_tok.get_vocab(), s_tok.get_vocab()
    if t_vocab != s_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(s_vocab.items()), key=lambda kv: kv[1])
        raise ValueError(
            f"--teacher {teacher}: its tokenizer is not --model's ({len(t_vocab)} and "
            f"{len(s_vocab)} tokens; first differing (token, id): {differ[:3]}): the teacher "
            "scores the student's token ids, so both must share one tokenizer")
    needed = max(s_vocab.values()) + 1
    for option, name, config in (("--teacher", teacher, t_config), ("--model", model, s_config)):
        rows = getattr(config, "vocab_size", None)
        if rows is not None and rows < needed:
            raise ValueError(f"{option} {name}: its embedding has {rows} rows, too few for the "
                             f"tokenizer's ids 0..{needed - 1}")
