"""The pieces algorithms are built from: advantages, KL estimators, policy and value losses.

Each function is small, works on padded [rows, tokens] tensors with a boolean `mask` of the
positions that count, and documents its formula. Notation: r reward, A advantage, ρ = π/π_old
the probability ratio, ε clip range, G group size. Padded positions may hold anything (0, −inf,
garbage): the losses zero them with `masked` before any exp, so they give 0, never NaN.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Tensor = torch.Tensor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_normalize: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """One advantage per row, relative to the other rows of its group.

    mean:          A_i = r_i − mean_g(r)
    mean+std:      A_i = (r_i − mean_g(r)) / (std_g(r) + eps)       (GRPO; std over the group,
                                                                    population form)
    leave-one-out: A_i = r_i − mean_{j≠i}(r_j) = G/(G−1) · (r_i − mean_g(r))   (RLOO)
    Dr.GRPO uses mean only (std_normalize=False) with a constant loss normalizer.
    A group of one row, or whose rewards are all equal (`flat_groups`), gets A = 0.
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
    """Generalised advantage estimation over the masked positions of each row.

    The masked positions are the steps t = 1..T of a row, in order; `rewards` holds the reward of
    each step (usually only the last one is non-zero) and V(T+1) is the row's `last_values`
    ([rows]; None: 0, every row ends in a terminal state):
        δ_t = r_t + γ V_{t+1} − V_t,   A_t = δ_t + γλ A_{t+1},   returns R_t = A_t + V_t.
    Unmasked positions get 0.
    """
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
    """x where `mask`, else 0: pads may hold ±inf or garbage, and exp(inf) · 0 is NaN in the loss
    and in its gradient, so losses zero them before any exp or log (their gradient is then 0)."""
    return torch.where(mask, x, 0)


KLEstimator = Literal["k1", "k2", "k3"]
"""Per-token *value* estimators of KL(π‖π_ref) on tokens y ~ π (Schulman, "Approximating KL
divergence"): E_π[k1] = E_π[k3] = KL exactly, E_π[k2] ≈ KL to second order. They are for the
reward penalty (`kl_in_reward`). Put in the loss their gradients are not ∇KL(π_θ‖π_ref): E_π[∇k1]
= 0 and E_π[∇k3] = ∇KL(π_ref‖π_θ), the forward KL; the loss uses `kl_loss` instead."""


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log π − log π_ref (unbiased, high variance, can be negative)."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½ (log π − log π_ref)² (biased, low variance, ≥ 0)."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1 (unbiased, ≥ 0; Schulman)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def old_logprobs(batch) -> Tensor:
    """log π_old of the advantages: the proximal log-probs where the actor's forward recomputed
    them (the `actor` role), else the behavior log-probs from generation."""
    return batch["prox_logprobs"] if "prox_logprobs" in batch.keys() else batch["logprobs"]


def reference_kl(batch, estimator: str) -> Tensor:
    """The per-token KL estimate `estimator` (`KL_ESTIMATORS`) of π_old against π_ref
    (`batch["ref_logprobs"]`, the `ref` role's forward), 0 on pads: the penalty of a reward."""
    mask = batch["loss_mask"]
    return KL_ESTIMATORS[estimator](masked(old_logprobs(batch), mask),
                                    masked(batch["ref_logprobs"], mask))


def roles(loss, *others: str) -> tuple[str, ...]:
    """An algorithm's role forwards before its advantages: the actor's own (π_prox) when
    `loss.recompute_proximal` (a `PolicyLossConfig`) asks for it, then `others` (critic, ref,
    teacher)."""
    return (("actor",) if loss.recompute_proximal else ()) + others


def kl_loss(logp: Tensor, ref_logp: Tensor, prox_logp: Tensor, weight: Tensor) -> Tensor:
    """Per-token KL(π_θ‖π_ref) term for the loss, on tokens sampled by π_behav:
        L_KL = w · ρ · k3,   ρ = π_θ / π_prox (with gradient),   w = π_prox / π_behav (without)
    so w·ρ = π_θ/π_behav is the importance ratio from the sampler to π_θ. Uncapped w gives
        value:     E_behav[w ρ k3] = E_θ[k3] = KL(π_θ‖π_ref)
        gradient:  ρ·k3 = π_ref/π_prox + ρ (log π_θ − log π_ref) − ρ, so
                   ∇(w ρ k3) = w ρ (log π_θ − log π_ref) ∇log π_θ   (per sample) and
                   E_behav[∇] = E_θ[(log π_θ − log π_ref) ∇log π_θ] = ∇KL(π_θ‖π_ref)
    (the reverse-KL gradient, Tang & Munos 2025; the same per-sample gradient as w ρ̄ k2 with ρ̄ a
    stop-gradient ratio, but the value is unbiased). Per token this is the gradient of each
    position's KL with its context held fixed; moving the contexts too is what k1 in the reward
    does. A capped w (`importance_weight`) trades this exactness for bounded variance."""
    return weight.detach() * torch.exp(logp - prox_logp) * kl_k3(logp, ref_logp)


def ppo_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token clipped policy loss and where clipping was active.

    ρ = exp(log π − log π_old);  L = −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high) A)
    dual clip (c > 1), for A < 0 only:  L = min(L, −c A)  — bounds the loss of very large ρ.
    """
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
    """Decoupled PPO's behavior correction w = π_prox / π_behav = exp(log π_prox − log π_behav),
    capped at `cap` (None: uncapped). Returns the weight and where the cap applied."""
    w = torch.exp(prox_logp - behav_logp)
    if cap is None:
        return w, torch.zeros_like(w, dtype=torch.bool)
    return w.clamp(max=cap), w > cap


def interpolate_proximal(behav_logp: Tensor, current_logp: Tensor, versions: Tensor,
                         prox_version: Tensor, progress: Tensor) -> Tensor:
    """log π_prox without a forward pass, log-linear in policy versions (per token).

    The token was sampled by version v_b (`versions`), π_prox is version v_p (`prox_version`,
    per row) and the weights being trained are v_θ = v_p + `progress` (the fraction of this
    batch's optimizer steps already taken, per row):
        log π_prox ≈ log π_b + α (log π_θ − log π_b),   α = (v_p − v_b) / (v_θ − v_b)
    Exact at both ends: a token of the current version (v_b = v_p) keeps its behavior logprob
    (the same weights; an inference/trainer numerical mismatch then lands in ρ, not in w), and
    before the first optimizer step (progress 0) π_prox = π_θ. In between, i.e. stale tokens on
    the 2nd..M-th mini-batch of a batch, it is an approximation: it assumes log π moves linearly
    with versions and each optimizer step is 1/M of a version. `current_logp` is detached.
    """
    v_b = versions.to(torch.float64)
    v_p = prox_version.to(torch.float64)[:, None]
    span = v_p + progress.to(torch.float64)[:, None] - v_b
    alpha = torch.where(span > 0, (v_p - v_b) / span.clamp(min=1e-12), 0.0).to(behav_logp.dtype)
    return behav_logp + alpha * (current_logp.detach() - behav_logp)


def decoupled_policy_loss(logp: Tensor, mb, config) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO loss per token for a micro-batch `mb`, and stats that show it:
        L = w · max(−ρA, −clip(ρ, 1 − ε_low, 1 + ε_high) A)  (+ dual clip),
        ρ = π_θ / π_prox,   w = min(π_prox / π_behav, cap)   (w carries no gradient)
    `config` is a `PolicyLossConfig`; π_behav, π_prox as `behavior_and_proximal` gives them, and
    w, π_prox as `behavior_weight` changes them for `config.mismatch_correction`.
    """
    mask = mb["loss_mask"]
    logp = masked(logp, mask)
    behav, prox, weight, capped, stats = behavior_weight(logp, mb, config)
    surrogate, clipped = ppo_surrogate(logp, prox, masked(mb["advantages"], mask),
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


def behavior_and_proximal(logp: Tensor, mb) -> tuple[Tensor, Tensor]:
    """(log π_behav, log π_prox), 0 on pads. π_behav is `mb["logprobs"]` (from generation);
    π_prox is `mb["prox_logprobs"]` when the runtime recomputed it (the algorithm has the `actor`
    role), else `interpolate_proximal` from the masked `logp` (see there for when that is exact)."""
    mask = mb["loss_mask"]
    behav = masked(mb["logprobs"], mask)
    if "prox_logprobs" in mb.keys():
        return behav, masked(mb["prox_logprobs"], mask)
    return behav, interpolate_proximal(behav, logp, mb["versions"], mb["policy_version"],
                                       mb["minibatch_progress"])


def rollout_mismatch(logp: Tensor, mb) -> tuple[Tensor, Tensor]:
    """(log π_train, known): the trainer's logprob of each token at the weights that sampled it,
    where that is known exactly, and where (0 elsewhere). π_rollout = `mb["logprobs"]` is the
    inference engine's logprob at the same weights, so log π_train − log π_rollout there is pure
    numerical mismatch (kernels, dtype, batching), no policy change.

    Known: loss tokens of the version being trained (`versions == policy_version`: the trainer
    holds exactly those weights until this batch's first optimizer step), taking
    `mb["prox_logprobs"]` when recomputed (a forward pass before the update: every mini-batch),
    else `logp` (detached) on the first mini-batch only (`minibatch_progress == 0`). Stale tokens
    came from weights the trainer no longer has: never known. Without `versions` or
    `policy_version` in `mb` (a hand-built micro-batch) nothing is."""
    mask = mb["loss_mask"]
    keys = mb.keys()
    if "versions" not in keys or "policy_version" not in keys:
        return torch.zeros_like(logp), torch.zeros_like(mask)
    known = mask & (mb["versions"] == mb["policy_version"][:, None])
    if "prox_logprobs" in keys:
        train = mb["prox_logprobs"]
    else:
        train = logp.detach()
        known = known & (mb["minibatch_progress"] == 0)[:, None]
    return masked(train, known), known


def _outside(log_ratio: Tensor, known: Tensor, band: tuple[float, float]) -> Tensor:
    return known & ((log_ratio < math.log(band[0])) | (log_ratio > math.log(band[1])))


def drop_nothing(log_ratio: Tensor, known: Tensor, band: tuple[float, float]) -> Tensor:
    return torch.zeros_like(known)


def drop_tokens(log_ratio: Tensor, known: Tensor, band: tuple[float, float]) -> Tensor:
    """The known tokens whose r = exp(`log_ratio`) is outside `band` = [low, high]."""
    return _outside(log_ratio, known, band)


def drop_sequences(log_ratio: Tensor, known: Tensor, band: tuple[float, float]) -> Tensor:
    """Every token of a row one of whose known tokens has r outside `band`."""
    return _outside(log_ratio, known, band).any(-1, keepdim=True).expand_as(known)


def drop_geometric(log_ratio: Tensor, known: Tensor, band: tuple[float, float]) -> Tensor:
    """Every token of a row whose geometric-mean r over its known tokens, exp(mean log r), is
    outside `band`; a row without known tokens is kept."""
    count = known.sum(-1, keepdim=True)
    mean = masked(log_ratio, known).sum(-1, keepdim=True) / count.clamp(min=1)
    return _outside(mean, count > 0, band).expand_as(known)


def decoupled_weight(prox: Tensor, behav: Tensor, train: Tensor, known: Tensor,
                     config) -> tuple[Tensor, Tensor, Tensor]:
    """(log π_prox, w, capped) of decoupled PPO: w = min(π_prox/π_behav, importance_weight_cap)."""
    return prox, *importance_weight(prox, behav, config.importance_weight_cap)


def truncated_weight(prox: Tensor, behav: Tensor, train: Tensor, known: Tensor,
                     config) -> tuple[Tensor, Tensor, Tensor]:
    """TIS on the known tokens: π_prox := π_train and w = min(π_train/π_rollout, mismatch_cap);
    `decoupled_weight` elsewhere."""
    prox = torch.where(known, train, prox)
    _, weight, capped = decoupled_weight(prox, behav, train, known, config)
    tis, tis_capped = importance_weight(prox, behav, config.mismatch_cap)
    return prox, torch.where(known, tis, weight), torch.where(known, tis_capped, capped)


MISMATCH_CORRECTIONS = {
    "auto": (decoupled_weight, drop_nothing),  # unresolved (no recipe chose): none's
    "none": (decoupled_weight, drop_nothing),
    "tis": (truncated_weight, drop_nothing),
    "token_mask": (decoupled_weight, drop_tokens),
    "sequence_mask": (decoupled_weight, drop_sequences),
    "geometric_mask": (decoupled_weight, drop_geometric),
}
"""(weight, drop) of each `PolicyLossConfig.mismatch_correction`: the behavior weight, and the
tokens whose loss is zeroed, from r = π_train/π_rollout on the known tokens."""


def behavior_weight(logp: Tensor, mb, config) -> tuple[Tensor, Tensor, Tensor, Tensor, dict]:
    """(log π_behav, log π_prox, w, capped, stats): the behavior weight w (no gradient) that the
    policy surrogate and the KL term carry, with `config.mismatch_correction` applied, and the
    `mismatch/...` stats of the micro-batch. `logp` is already masked. On the tokens where
    π_train is known (`rollout_mismatch`), r = π_train/π_rollout, C = `mismatch_cap`:
        none:         w = min(π_prox/π_behav, importance_weight_cap)    (`decoupled_weight`)
        tis:          π_prox := π_train and w = min(r, C) on known tokens; none's elsewhere
        *_mask:       none's w, times 0 on the tokens `drop_tokens`/`_sequences`/`_geometric` drop
    With π_prox recomputed, none's w on a known token already is min(r, cap): tis then only caps
    it at C; without, none's w there is 1 (π_prox := π_behav) and tis is what corrects it."""
    mask = mb["loss_mask"]
    weigh, drop = MISMATCH_CORRECTIONS[config.mismatch_correction]
    behav, prox = behavior_and_proximal(logp, mb)
    train, known = rollout_mismatch(logp, mb)
    if drop is not drop_nothing or weigh is not decoupled_weight:
        if not {"versions", "policy_version"} <= set(mb.keys()):
            raise ValueError(f"mismatch_correction {config.mismatch_correction!r} needs the "
                             "batch keys 'versions' and 'policy_version' (set by the scheduler)")
    log_ratio = train - masked(mb["logprobs"], known)  # 0 off `known`
    prox, weight, capped = weigh(prox, behav, train, known, config)
    dropped = drop(log_ratio, known, config.mismatch_band)
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


def actor_loss(out, mb, config):
    """The policy's `LossOutput` for GRPO and PPO: the decoupled policy loss, plus β·`kl_loss`
    per token when the KL penalty is in the loss (its gradient is β·∇KL(π_θ‖π_ref) whatever
    `kl_estimator` says: that one is for the reward), minus the entropy bonus, aggregated as
    `config.loss.aggregation` says. `config` has `loss`, `kl_coef`, `kl_estimator`,
    `kl_in_reward` and `entropy_coef` (`GRPOConfig`, `PPOConfig`)."""
    mask = mb["loss_mask"]
    n = mask.sum().clamp(min=1)
    per_token, stats = decoupled_policy_loss(out.logprobs, mb, config.loss)
    if config.kl_coef > 0 and not config.kl_in_reward:
        logp = masked(out.logprobs, mask)
        _, prox, weight, _, _ = behavior_weight(logp, mb, config.loss)
        kl = kl_loss(logp, masked(mb["ref_logprobs"], mask), prox, weight)
        per_token = per_token + config.kl_coef * kl
        stats["kl_ref"] = (kl.detach() * mask).sum() / n  # ≈ KL(π_θ‖π_ref) per token
    entropy = None if out.entropy is None else masked(out.entropy, mask)
    if config.entropy_coef > 0:
        per_token = per_token + entropy_bonus(entropy, config.entropy_coef)
    if entropy is not None:
        stats["entropy"] = entropy.detach().sum() / n
    return aggregate(per_token, mask, config.loss.aggregation, stats)


def actor_loss_skips_zero_advantage(config) -> bool:
    """Whether `actor_loss` and its gradient are 0 on a row whose advantages are all 0 (the
    runtime then gives it no forward: `skips_zero_advantage_rows`): neither a KL term in the
    loss nor an entropy bonus."""
    return (config.kl_coef == 0 or config.kl_in_reward) and config.entropy_coef == 0


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean) / (std + eps) over the masked positions of the whole batch; 0 elsewhere."""
    n = mask.sum().clamp(min=1)
    mean = masked(values, mask).sum() / n
    std = (masked(values - mean, mask) ** 2).sum() / n
    return masked((values - mean) / (std.sqrt() + eps), mask)


def final_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Each row's scalar reward placed on its last masked position (the rest 0), for GAE."""
    width = mask.shape[-1]
    last = (mask.long() * torch.arange(width)).argmax(-1)
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
    from areal_flow.types import LossOutput

    loss_sum, normalizer, unit = AGGREGATIONS[aggregation](per_token, mask)
    return LossOutput(loss_sum=loss_sum, normalizer=normalizer, unit=unit, stats=stats)


def overlong_penalty(lengths: Tensor, *, max_length: int, cache: int,
                     factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward:
        0                                  if L ≤ max − cache
        −factor · (L − (max − cache)) / cache   if max − cache < L ≤ max
        −factor                            if L > max
    """
    start = max_length - cache
    soft = -factor * (lengths.float() - start) / max(cache, 1)
    return torch.where(lengths <= start, torch.zeros_like(soft),
                       torch.where(lengths <= max_length, soft, torch.full_like(soft, -factor)))


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
                       eps: float) -> Tensor:
    """Per-token ½ max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²)."""
    clipped = old_values + (values - old_values).clamp(-eps, eps)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def entropy_bonus(entropy: Tensor, coef: float) -> Tensor:
    """Per-token −coef · H: adding it to the loss rewards higher entropy."""
    return -coef * entropy
