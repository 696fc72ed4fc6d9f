"""The pieces algorithms are built from: advantages, KL estimators, policy and value losses.

Tensors are padded [rows, tokens], a bool `mask` marking the positions that count (pads may hold
−inf: losses zero them). Notation: r reward, A advantage, ρ = π/π_old, ε clip, G group size."""

from __future__ import annotations

import math

import torch

from areal_flow.types import LossOutput, MicroBatch, ModelOutput

Tensor = torch.Tensor


def group_advantages(rewards: Tensor, group_ids: Tensor, *, std_normalize: bool = True,
                     leave_one_out: bool = False, eps: float = 1e-6) -> Tensor:
    """One advantage per row, relative to its group; 0 in `flat_groups`.
    mean:          A_i = r_i − mean_g(r)                              (Dr.GRPO)
    mean+std:      A_i = (r_i − mean_g(r)) / (std_g(r) + eps)         (GRPO; population std)
    leave-one-out: A_i = r_i − mean_{j≠i}(r_j) = G/(G−1) · (r_i − mean_g(r))   (RLOO)
    """
    rewards = rewards.float()
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, index, rewards)
    mean = (sums / counts)[index]
    centered = rewards - mean
    size = counts[index].to(rewards.dtype)
    if leave_one_out:
        centered = torch.where(size > 1, centered * size / (size - 1).clamp(min=1), 0.0)
    if std_normalize:
        sq = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, index, (rewards - mean) ** 2)
        std = (sq / counts).sqrt()[index]
        centered = centered / (std + eps)
    # A group whose rewards are all equal carries no signal: exactly 0, not rounding noise / eps.
    return torch.where(flat_groups(rewards, group_ids), torch.zeros_like(centered), centered)


def flat_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """[rows] bool: the row's group has one row, or all its rewards are equal (no signal)."""
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    high = torch.full((len(counts),), -torch.inf).scatter_reduce(0, index, rewards.float(), "amax")
    low = torch.full((len(counts),), torch.inf).scatter_reduce(0, index, rewards.float(), "amin")
    return ((high == low) | (counts == 1))[index]


def scale_rewards(rewards: Tensor, *, scale: float = 1.0, bias: float = 0.0,
                  clip: float | None = None) -> Tensor:
    """r' = clip((r + bias) · scale, −clip, clip)."""
    out = (rewards + bias) * scale
    return out.clamp(-clip, clip) if clip is not None else out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0,
        lam: float = 1.0, last_values: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(advantages, returns) by GAE over each row's masked positions (steps t = 1..T), else 0:
        δ_t = r_t + γ V_{t+1} − V_t,   A_t = δ_t + γλ A_{t+1},   R_t = A_t + V_t
    V_{T+1} is `last_values` ([rows]; None: 0, a terminal state)."""
    rewards, values = masked(rewards, mask).float(), masked(values, mask).float()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(len(values)) if last_values is None else last_values.float()
    running = torch.zeros(len(values))
    for t in reversed(range(values.shape[1])):  # one column at a time, all rows at once
        live = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(live, delta + gamma * lam * running, running)
        next_value = torch.where(live, values[:, t], next_value)
        advantages[:, t] = torch.where(live, running, 0.0)
    return advantages, masked(advantages + values, mask)


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where `mask`, else 0: before any exp, as a pad's exp(inf) · 0 would be NaN."""
    return torch.where(mask, x, 0)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1 (unbiased, ≥ 0; Schulman)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS = {"k1": lambda logp, ref_logp: logp - ref_logp,
                 "k2": lambda logp, ref_logp: 0.5 * (logp - ref_logp) ** 2, "k3": kl_k3}
"""Per-token value estimators of KL(π‖π_ref) on y ~ π (Schulman): E[k1] = E[k3] = KL, k2 ≈ KL.
k1 = log π − log π_ref (unbiased, high variance, can be negative), k2 = ½ (log π − log π_ref)²
(biased, low variance, ≥ 0). For the reward penalty (`kl_in_reward`): their gradients are not
∇KL; the loss uses `kl_loss`."""


NO_ACTOR = ("the loss config has recompute_proximal=True, but the rows carry no prox_logprobs: "
            "give the algorithm the actor role (roles = F.roles(config.loss, ...)) or set "
            "PolicyLossConfig(recompute_proximal=False) to interpolate pi_prox")


def old_logprobs(batch, config) -> Tensor:
    """log π_old of a batch for advantages: `prox_logprobs` if `config.recompute_proximal` (the
    `actor` role's forward), else the behaviour `logprobs`."""
    if not config.recompute_proximal:
        return batch["logprobs"]
    if "prox_logprobs" not in batch.keys():
        raise ValueError(NO_ACTOR)
    return batch["prox_logprobs"]


def reference_kl(batch, estimator: str, config) -> Tensor:
    """Per-token KL estimate `estimator` of π_old against `ref_logprobs`, 0 on pads (reward)."""
    mask = batch["loss_mask"]
    return KL_ESTIMATORS[estimator](masked(old_logprobs(batch, config), mask),
                                    masked(batch["ref_logprobs"], mask))


def roles(loss, *others: str) -> tuple[str, ...]:
    """An algorithm's roles: `actor` (π_prox) if `loss.recompute_proximal`, then `others`."""
    return (("actor",) if loss.recompute_proximal else ()) + others


def kl_loss(logp: Tensor, ref_logp: Tensor, prox_logp: Tensor, weight: Tensor) -> Tensor:
    """Per-token KL(π_θ‖π_ref) loss term on tokens sampled by π_behav: L = w · ρ · k3, with
    ρ = π_θ/π_prox (with gradient), w = `weight` = π_prox/π_behav (without). Uncapped w: value and
    expected gradient are exactly KL(π_θ‖π_ref)'s, per position (Tang & Munos 2025)."""
    return weight.detach() * torch.exp(logp - prox_logp) * kl_k3(logp, ref_logp)


def ppo_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
                  eps_high: float | None = None,
                  dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token clipped policy loss and where clipping was active:
    L = −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high) A); dual clip c > 1 (A < 0): L = min(L, −cA)."""
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def importance_weight(prox_logp: Tensor, behav_logp: Tensor,
                      cap: float | None) -> tuple[Tensor, Tensor]:
    """(w, capped): w = min(π_prox / π_behav, `cap`) (None: uncapped) and where the cap applied."""
    w = torch.exp(prox_logp - behav_logp)
    if cap is None:
        return w, torch.zeros_like(w, dtype=torch.bool)
    return w.clamp(max=cap), w > cap


def interpolate_proximal(behav_logp: Tensor, current_logp: Tensor, versions: Tensor,
                         prox_version: Tensor, progress: Tensor) -> Tensor:
    """log π_prox without a forward pass, log-linear in policy versions (per token):
        log π_prox ≈ log π_b + α (log π_θ − log π_b),   α = (v_p − v_b) / (v_θ − v_b)
    v_b = `versions` (per token), v_p = `prox_version`, v_θ = v_p + `progress` (the fraction of
    the batch's optimizer steps taken; both per row). Exact for current-version tokens and before
    the first step; else it assumes log π moves linearly, 1/M of a version per step."""
    v_b = versions.to(torch.float64)
    v_p = prox_version.to(torch.float64)[:, None]
    span = v_p + progress.to(torch.float64)[:, None] - v_b
    alpha = torch.where(span > 0, (v_p - v_b) / span.clamp(min=1e-12), 0.0).to(behav_logp.dtype)
    return behav_logp + alpha * (current_logp.detach() - behav_logp)


def decoupled_policy_loss(logp: Tensor, mb: MicroBatch,
                          config) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO loss per token of micro-batch `mb` (`config`: a `PolicyLossConfig`),
    and its stats: L = w · max(−ρA, −clip(ρ, 1 − ε_low, 1 + ε_high) A) (+ dual clip), with
    ρ = π_θ / π_prox and w = min(π_prox / π_behav, cap) without gradient (`behavior_weight`)."""
    mask = mb.loss_mask
    logp = masked(logp, mask)
    behav, prox, weight, capped, stats = behavior_weight(logp, mb, config)
    surrogate, clipped = ppo_surrogate(logp, prox, masked(mb.advantages, mask),
                                       eps_low=config.eps_clip, eps_high=config.eps_clip_high,
                                       dual_clip=config.dual_clip)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats |= {
            "clip_fraction": (clipped & mask).sum() / n,
            "importance_weight_mean": (weight * mask).sum() / n,
            "importance_weight_max": (weight * mask).max(),
            "capped_fraction": (capped & mask).sum() / n,
            "approx_kl": ((behav - logp) * mask).sum() / n,
        }
    return weight * surrogate, stats


def behavior_and_proximal(logp: Tensor, mb: MicroBatch, config) -> tuple[Tensor, Tensor]:
    """(log π_behav, log π_prox), 0 on pads: `mb.logprobs`, and `mb.prox_logprobs` if
    `config.recompute_proximal`, else `interpolate_proximal` from the masked `logp`."""
    behav = masked(mb.logprobs, mb.loss_mask)
    if config.recompute_proximal:
        if mb.prox_logprobs is None:
            raise ValueError(NO_ACTOR)
        return behav, masked(mb.prox_logprobs, mb.loss_mask)
    return behav, interpolate_proximal(behav, logp, mb.versions, mb.policy_version,
                                       mb.minibatch_progress)


def rollout_mismatch(logp: Tensor, mb: MicroBatch, config) -> tuple[Tensor, Tensor]:
    """(log π_train, known): the trainer's logprob of each token at the weights that sampled it,
    where known (loss tokens of the trained version: `prox_logprobs` if recomputed, else `logp`
    on the first mini-batch), else 0; log π_train − `mb.logprobs` is then pure numerical
    mismatch. Rows without versions (not from the scheduler) know none."""
    mask = mb.loss_mask
    if mb.versions is None or mb.policy_version is None:
        return torch.zeros_like(logp), torch.zeros_like(mask)
    known = mask & (mb.versions == mb.policy_version[:, None])
    if config.recompute_proximal:
        train = mb.prox_logprobs
    else:
        train = logp.detach()
        known = known & (mb.minibatch_progress == 0)[:, None]
    return masked(train, known), known


def drop_tokens(log_ratio: Tensor, known: Tensor, band: tuple[float, float]) -> Tensor:
    """The known tokens whose r = exp(`log_ratio`) is outside `band` = [low, high]."""
    return known & ((log_ratio < math.log(band[0])) | (log_ratio > math.log(band[1])))


def drop_sequences(log_ratio: Tensor, known: Tensor, band: tuple[float, float]) -> Tensor:
    """Every token of a row one of whose known tokens has r outside `band`."""
    return drop_tokens(log_ratio, known, band).any(-1, keepdim=True).expand_as(known)


def drop_geometric(log_ratio: Tensor, known: Tensor, band: tuple[float, float]) -> Tensor:
    """Every token of a row whose geometric-mean r over known tokens is outside `band`."""
    count = known.sum(-1, keepdim=True)
    mean = masked(log_ratio, known).sum(-1, keepdim=True) / count.clamp(min=1)
    return drop_tokens(mean, count > 0, band).expand_as(known)


MISMATCH_CORRECTIONS = {
    "auto": (False, None),  # unresolved (no recipe chose): none's
    "none": (False, None),
    "tis": (True, None),
    "token_mask": (False, drop_tokens),
    "sequence_mask": (False, drop_sequences),
    "geometric_mask": (False, drop_geometric),
}
"""(truncated, drop) of each `PolicyLossConfig.mismatch_correction`: TIS weighs known tokens by
min(π_train/π_rollout, mismatch_cap); drop (or None) zeroes tokens' loss."""


def behavior_weight(logp: Tensor, mb: MicroBatch,
                    config) -> tuple[Tensor, Tensor, Tensor, Tensor, dict]:
    """(log π_behav, log π_prox, w, capped, stats): the detached behavior weight of surrogate and
    KL term under `config.mismatch_correction`, and `mismatch/...` stats; `logp` is masked.
    Decoupled PPO's w = min(π_prox/π_behav, importance_weight_cap)."""
    mask = mb.loss_mask
    truncated, drop = MISMATCH_CORRECTIONS[config.mismatch_correction]
    behav, prox = behavior_and_proximal(logp, mb, config)
    train, known = rollout_mismatch(logp, mb, config)
    if (truncated or drop) and (mb.versions is None or mb.policy_version is None):
        raise ValueError(f"mismatch_correction {config.mismatch_correction!r} needs the "
                         "rows' 'versions' and 'policy_version' (set by the scheduler)")
    log_ratio = train - masked(mb.logprobs, known)  # 0 off `known`
    weight, capped = importance_weight(prox, behav, config.importance_weight_cap)
    if truncated:  # TIS: on known tokens π_prox := π_train, w = min(π_train/π_rollout, cap)
        prox = torch.where(known, train, prox)
        tis, tis_capped = importance_weight(prox, behav, config.mismatch_cap)
        weight, capped = torch.where(known, tis, weight), torch.where(known, tis_capped, capped)
    dropped = drop(log_ratio, known, config.mismatch_band) if drop else torch.zeros_like(known)
    weight = torch.where(dropped, 0.0, weight).detach()
    with torch.no_grad():
        n, m = mask.sum().clamp(min=1), known.sum()
        size = log_ratio.abs()
        stats = {
            "mismatch/measured_fraction": m / n,
            "mismatch/abs_log_ratio_mean": size.sum() / m.clamp(min=1),
            "mismatch/abs_log_ratio_max": size.max() if size.numel() else size.sum(),
            "mismatch/outside_cap_fraction":
                (known & (size > math.log(config.mismatch_cap))).sum() / m.clamp(min=1),
            "mismatch/masked_fraction": (mask & dropped).sum() / n,
        }
    return behav, prox, weight, capped, stats


def actor_loss(out: ModelOutput, mb: MicroBatch, config,
               entropy_coef: float | Tensor | None = None) -> LossOutput:
    """The policy's `LossOutput` for GRPO and PPO (`config`): decoupled policy loss + β·`kl_loss`
    (unless `kl_in_reward`) − entropy bonus, aggregated by `config.loss.aggregation`.
    `entropy_coef`: the bonus' coefficient, one or [rows, 1] (default `config.entropy_coef`)."""
    mask = mb.loss_mask
    n = mask.sum().clamp(min=1)
    per_token, stats = decoupled_policy_loss(out.logprobs, mb, config.loss)
    if config.kl_coef > 0 and not config.kl_in_reward:
        logp = masked(out.logprobs, mask)
        _, prox, weight, _, _ = behavior_weight(logp, mb, config.loss)
        kl = kl_loss(logp, masked(mb.ref_logprobs, mask), prox, weight)
        per_token = per_token + config.kl_coef * kl
        stats["kl_ref"] = (kl.detach() * mask).sum() / n  # ≈ KL(π_θ‖π_ref) per token
    entropy = None if out.entropy is None else masked(out.entropy, mask)
    coef = config.entropy_coef if entropy_coef is None else entropy_coef
    if isinstance(coef, Tensor):
        stats["entropy_coef"] = coef.detach().mean()
        coef = coef if bool(coef.any()) else 0.0  # rows trained without entropy's gradient
    if isinstance(coef, Tensor) or coef > 0:
        per_token = per_token + entropy_bonus(entropy, coef)
    if entropy is not None:
        stats["entropy"] = entropy.detach().sum() / n
    return aggregate(per_token, mask, config.loss.aggregation, stats)


def actor_loss_skips_zero_advantage(config) -> bool:
    """Whether `actor_loss` is 0 on rows of all-zero advantages (no KL loss, no entropy bonus)."""
    return (config.kl_coef == 0 or config.kl_in_reward) and config.entropy_coef == 0


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean) / (std + eps) over the masked positions of the whole batch; 0 elsewhere."""
    n = mask.sum().clamp(min=1)
    mean = masked(values, mask).sum() / n
    std = (masked(values - mean, mask) ** 2).sum() / n
    return masked((values - mean) / (std.sqrt() + eps), mask)


def final_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Each row's scalar reward placed on its last masked position (the rest 0), for GAE."""
    last = (mask.long() * torch.arange(mask.shape[-1])).argmax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has = mask.any(-1)
    out[has, last[has]] = rewards[has].float()
    return out


def token_level(per_token: Tensor, mask: Tensor) -> tuple[Tensor, float, str]:
    """Sum over every masked token, normalised by the number of tokens in the whole batch."""
    return masked(per_token, mask).sum(), float(mask.sum()), "tokens"


def sequence_level(per_token: Tensor, mask: Tensor) -> tuple[Tensor, float, str]:
    """Each row's token mean, summed, normalised by the number of rows with model tokens."""
    lengths = mask.sum(-1)
    has = lengths > 0
    per_row = masked(per_token, mask).sum(-1) / lengths.clamp(min=1)
    return per_row[has].sum(), float(has.sum()), "sequences"


AGGREGATIONS = {"token": token_level, "sequence": sequence_level}
"""(loss_sum, normalizer, unit) of a per-token loss, by `PolicyLossConfig.aggregation`."""


def aggregate(per_token: Tensor, mask: Tensor, aggregation: str, stats: dict):
    """The `LossOutput` of a per-token loss, aggregated as `aggregation` (`AGGREGATIONS`)."""
    loss_sum, normalizer, unit = AGGREGATIONS[aggregation](per_token, mask)
    return LossOutput(loss_sum=loss_sum, normalizer=normalizer, unit=unit, stats=stats)


def overlong_penalty(lengths: Tensor, *, max_length: int, cache: int,
                     factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to L = max − cache, then
    linear down to −factor at L = max, −factor beyond."""
    start = max_length - cache
    soft = -factor * (lengths.float() - start) / max(cache, 1)
    return torch.where(lengths <= start, torch.zeros_like(soft),
                       torch.where(lengths <= max_length, soft, torch.full_like(soft, -factor)))


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
                       eps: float) -> Tensor:
    """Per-token ½ max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²)."""
    clipped = old_values + (values - old_values).clamp(-eps, eps)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def entropy_bonus(entropy: Tensor, coef: float | Tensor) -> Tensor:
    """Per-token −coef · H: adding it to the loss rewards higher entropy."""
    return -coef * entropy
