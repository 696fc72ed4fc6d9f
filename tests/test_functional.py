"""Every functional piece against a reference written here with plain Python loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow.algorithms import functional as F
from areal_flow.algorithms.grpo import GRPOConfig
from areal_flow.config import PolicyLossConfig
from areal_flow.types import MicroBatch, ModelOutput

finite = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def grouped_rewards(draw):
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    group_ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    order = draw(st.permutations(range(len(group_ids))))  # rows of a group need not be adjacent
    rewards = [draw(finite) for _ in group_ids]
    return [rewards[i] for i in order], [group_ids[i] for i in order]


@settings(max_examples=150, deadline=None)
@given(grouped_rewards(), st.booleans(), st.booleans())
def test_group_advantages_match_the_reference(data, std_normalize, leave_one_out):
    rewards, group_ids = data
    got = F.group_advantages(torch.tensor(rewards), torch.tensor(group_ids),
                             std_normalize=std_normalize, leave_one_out=leave_one_out)
    for i, (r, g) in enumerate(zip(rewards, group_ids)):
        members = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g]
        if len(members) == 1:
            expected = 0.0
        else:
            mean = sum(members) / len(members)
            expected = r - mean
            if leave_one_out:
                others = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g and j != i]
                expected = r - sum(others) / len(others)
            if std_normalize:
                expected /= statistics.pstdev(members) + 1e-6
        assert got[i].item() == pytest.approx(expected, rel=1e-3, abs=1e-3)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(finite, finite, st.booleans()), min_size=1, max_size=12),
       st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.one_of(st.none(), finite))
def test_gae_matches_the_recursive_definition(steps, gamma, lam, bootstrap):
    rewards = torch.tensor([[r for r, _, _ in steps]])
    values = torch.tensor([[v for _, v, _ in steps]])
    mask = torch.tensor([[m for _, _, m in steps]])
    adv, ret = F.gae(rewards, values, mask, gamma=gamma, lam=lam,
                     last_values=None if bootstrap is None else torch.tensor([bootstrap]))
    live = [i for i, (_, _, m) in enumerate(steps) if m]
    end = 0.0 if bootstrap is None else bootstrap  # V(T+1): terminal, or the bootstrap value
    expected = {}
    for k in range(len(live)):  # A_t = Σ_l (γλ)^l δ_{t+l}, written out, not recursively
        total = 0.0
        for offset, t in enumerate(live[k:]):
            nxt = steps[live[k + offset + 1]][1] if k + offset + 1 < len(live) else end
            delta = steps[t][0] + gamma * nxt - steps[t][1]
            total += (gamma * lam) ** offset * delta
        expected[live[k]] = total
    for i in range(len(steps)):
        want = expected.get(i, 0.0)
        assert adv[0, i].item() == pytest.approx(want, rel=1e-3, abs=1e-3)
        assert ret[0, i].item() == pytest.approx(want + steps[i][1] if i in expected else 0.0,
                                                 rel=1e-3, abs=1e-3)


@st.composite
def categoricals(draw, n):
    """n log-distributions over the same K = 3..6 categories, from random logits."""
    k = draw(st.integers(3, 6))
    logits = st.lists(st.floats(-3, 3), min_size=k, max_size=k)
    return [torch.log_softmax(torch.tensor(draw(logits), dtype=torch.float64), 0)
            for _ in range(n)]


@settings(max_examples=100, deadline=None)
@given(categoricals(2))
def test_k1_and_k3_average_to_the_kl_and_k2_k3_are_never_negative(dists):
    logp, ref = dists
    kl = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=logp),
                                           torch.distributions.Categorical(logits=ref)).item()
    for name in ("k1", "k3"):  # E_{y~π}[k(y)], enumerating every y
        estimate = (logp.exp() * F.KL_ESTIMATORS[name](logp, ref)).sum().item()
        assert estimate == pytest.approx(kl, rel=1e-9, abs=1e-12), name
    assert (F.KL_ESTIMATORS["k2"](logp, ref) >= 0).all()
    assert (F.KL_ESTIMATORS["k3"](logp, ref) >= -1e-12).all()


def one_token(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, 1)


@settings(max_examples=100, deadline=None)
@given(categoricals(4), st.sampled_from(["π_θ", "π_behav", "π_behav ≠ π_prox"]),
       st.floats(0.01, 2.0), st.sampled_from(["token", "sequence"]))
def test_the_kl_in_the_loss_has_the_reverse_kl_gradient_under_any_sampler(dists, sampler, beta,
                                                                         aggregation):
    """E_{y~π_behav}[L(y)] = β KL(π_θ‖π_ref) and E[∇L] = β ∇KL, the expectation taken exactly over
    every y, for tokens sampled by π_θ itself or by another policy (whose importance weight the
    loss applies), against autograd on the closed form Σ_k p_k (log p_k − log q_k)."""
    theta = dists[0].clone().requires_grad_()  # logits of π_θ
    logp, ref = torch.log_softmax(theta, 0), dists[1]
    behav = logp.detach() if sampler == "π_θ" else dists[2]
    prox = dists[3] if sampler == "π_behav ≠ π_prox" else behav
    config = GRPOConfig(kl_coef=beta, loss=PolicyLossConfig(importance_weight_cap=None,
                                                            aggregation=aggregation))
    expected_loss = 0.0
    for y in range(len(logp)):  # A = 0: the loss is the KL term alone
        mb = MicroBatch(loss_mask=torch.tensor([[True]]), logprobs=one_token(behav[y]),
                        prox_logprobs=one_token(prox[y]), ref_logprobs=one_token(ref[y]),
                        advantages=torch.zeros(1, 1, dtype=torch.float64))
        out = F.actor_loss(ModelOutput(logprobs=one_token(logp[y])), mb, config)
        expected_loss = expected_loss + behav[y].exp() * out.loss_sum
    (grad,) = torch.autograd.grad(expected_loss, theta)

    logits = dists[0].clone().requires_grad_()
    p, q = torch.softmax(logits, 0), torch.softmax(ref, 0)
    kl = (p * (p.log() - q.log())).sum()
    (want,) = torch.autograd.grad(kl, logits)
    assert expected_loss.item() == pytest.approx(beta * kl.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, beta * want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("garbage", [math.inf, -math.inf, 1e30, -1e30, math.nan])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_garbage_at_padded_positions_changes_nothing(garbage, recompute, aggregation):
    """±inf, huge or NaN on the pads of every input: finite loss and stats, zero gradient there,
    and the same loss and gradients as the batch with zeros on its pads."""
    mask = torch.tensor([[True, True, False], [True, False, False]])
    g = torch.Generator().manual_seed(0)
    clean = {key: -2 * torch.rand(2, 3, generator=g) * mask
             for key in ("logp", "entropy", "logprobs", "prox_logprobs", "ref_logprobs")}
    clean["advantages"] = torch.randn(2, 3, generator=g) * mask
    config = GRPOConfig(kl_coef=0.1, entropy_coef=0.01, loss=PolicyLossConfig(
        aggregation=aggregation, recompute_proximal=recompute))
    results = []
    for pad in (0.0, garbage):
        x = {key: torch.where(mask, t, pad) for key, t in clean.items()}
        logp, entropy = x.pop("logp").requires_grad_(), x.pop("entropy").requires_grad_()
        mb = {"loss_mask": mask, "versions": torch.tensor([[1, 2, -1], [2, -1, -1]]),
              "policy_version": torch.tensor([2, 2]),
              "minibatch_progress": torch.tensor([0.5, 0.5]), **x}
        if not recompute:
            del mb["prox_logprobs"]
        out = F.actor_loss(ModelOutput(logprobs=logp, entropy=entropy), MicroBatch(**mb), config)
        out.loss_sum.backward()
        assert all(math.isfinite(float(v)) for v in out.stats.values()), out.stats
        assert (logp.grad[~mask] == 0).all() and (entropy.grad[~mask] == 0).all()
        results.append((out.loss_sum, logp.grad, entropy.grad))
    for zeros, pads in zip(*results):
        torch.testing.assert_close(pads, zeros)


@settings(max_examples=200)
@given(st.floats(-3, 3), st.floats(-3, 3), finite, st.floats(0.05, 0.5), st.floats(0.05, 0.5),
       st.one_of(st.none(), st.floats(1.5, 5)))
def test_ppo_surrogate_matches_the_reference(logp, old, adv, eps_low, eps_high, dual):
    loss, clipped = F.ppo_surrogate(torch.tensor(logp), torch.tensor(old), torch.tensor(adv),
                                    eps_low=eps_low, eps_high=eps_high, dual_clip=dual)
    ratio = math.exp(logp - old)
    expected = -min(ratio * adv, min(max(ratio, 1 - eps_low), 1 + eps_high) * adv)
    if dual is not None and adv < 0:
        expected = min(expected, -dual * adv)
    assert loss.item() == pytest.approx(expected, rel=1e-3, abs=1e-3)
    # clipping binds where the ratio left the range in the direction A pushes it (float32 aside)
    bounds = (1 - eps_low, 1 + eps_high) + ((dual,) if dual is not None else ())
    if abs(adv) > 1e-30 and all(abs(ratio - b) > 1e-4 * b for b in bounds):
        binds = (adv > 0 and ratio > 1 + eps_high) or (adv < 0 and ratio < 1 - eps_low) or \
            (adv < 0 and dual is not None and ratio > dual)
        assert bool(clipped) == binds


def test_ppo_gradient_is_the_policy_gradient_inside_the_clip_range_and_zero_outside():
    adv = torch.tensor([1.0, 1.0, -1.0])
    old = torch.zeros(3)
    logp = torch.tensor([0.0, 0.5, 0.0], requires_grad=True)  # ratio 1, e^0.5 > 1.2 (clipped), 1
    loss, clipped = F.ppo_surrogate(logp, old, adv, eps_low=0.2)
    loss.sum().backward()
    # inside: d(−ρA)/dlogp = −ρA; clipped with A > 0 beyond 1 + ε: no gradient
    torch.testing.assert_close(logp.grad, torch.tensor([-1.0, 0.0, 1.0]))
    assert clipped.tolist() == [False, True, False]
    # numerical check of the first entry
    h = 1e-3
    plus, _ = F.ppo_surrogate(torch.tensor(h), torch.tensor(0.0), torch.tensor(1.0))
    minus, _ = F.ppo_surrogate(torch.tensor(-h), torch.tensor(0.0), torch.tensor(1.0))
    assert ((plus - minus) / (2 * h)).item() == pytest.approx(-1.0, rel=1e-3)


@given(finite, finite, st.one_of(st.none(), st.floats(1.0, 10.0)))
def test_importance_weight_is_capped(prox, behav, cap):
    w, capped = F.importance_weight(torch.tensor(prox), torch.tensor(behav), cap)
    raw = math.exp(prox - behav)
    assert w.item() == pytest.approx(raw if cap is None else min(raw, cap), rel=1e-3)
    if cap is None or not math.isclose(raw, cap, rel_tol=1e-4):  # float32 near the cap: either
        assert bool(capped) == (cap is not None and raw > cap)


@given(st.lists(st.lists(st.tuples(finite, st.booleans()), min_size=1, max_size=6),
                min_size=1, max_size=5))
def test_token_and_sequence_aggregation(rows):
    width = max(len(r) for r in rows)
    values = torch.tensor([[v for v, _ in r] + [0.0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[m for _, m in r] + [False] * (width - len(r)) for r in rows])
    total, count, unit = F.AGGREGATIONS["token"](values, mask)
    assert unit == "tokens"
    picked = [v for r in rows for v, m in r if m]
    assert total.item() == pytest.approx(sum(picked), abs=1e-3) and count == len(picked)
    total, count, unit = F.AGGREGATIONS["sequence"](values, mask)
    assert unit == "sequences"
    means = [sum(v for v, m in r if m) / sum(m for _, m in r) for r in rows if any(m for _, m in r)]
    assert total.item() == pytest.approx(sum(means), abs=1e-3) and count == len(means)


@given(st.integers(0, 300), st.integers(50, 200), st.integers(1, 49), st.floats(0.1, 2))
def test_overlong_penalty(length, max_length, cache, factor):
    got = F.overlong_penalty(torch.tensor([length]), max_length=max_length, cache=cache,
                             factor=factor).item()
    if length <= max_length - cache:
        expected = 0.0
    elif length <= max_length:
        expected = -factor * (length - (max_length - cache)) / cache
    else:
        expected = -factor
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)


@given(finite, finite, finite, st.floats(0.01, 1.0))
def test_clipped_value_loss(v, old, ret, eps):
    got = F.clipped_value_loss(torch.tensor(v), torch.tensor(old), torch.tensor(ret), eps).item()
    clipped = old + max(-eps, min(eps, v - old))
    assert got == pytest.approx(0.5 * max((v - ret) ** 2, (clipped - ret) ** 2), rel=1e-3,
                                abs=1e-3)


@given(st.lists(finite, min_size=1, max_size=5), st.floats(0.5, 2), finite, st.floats(0.5, 5))
def test_reward_scaling(rewards, scale, bias, clip):
    got = F.scale_rewards(torch.tensor(rewards), scale=scale, bias=bias, clip=clip)
    for g, r in zip(got.tolist(), rewards):
        assert g == pytest.approx(max(-clip, min(clip, (r + bias) * scale)), rel=1e-4, abs=1e-4)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(finite, finite, st.integers(0, 6)), min_size=1, max_size=10),
       st.integers(0, 4), st.sampled_from([0.0, 0.25, 0.5, 0.75]))
def test_interpolate_proximal_is_log_linear_in_versions(tokens, ahead, progress):
    behav = [b for b, _, _ in tokens]
    current = [c for _, c, _ in tokens]
    prox_version = max(v for _, _, v in tokens) + ahead  # the trainer is never behind a token
    got = F.interpolate_proximal(
        torch.tensor([behav]), torch.tensor([current]),
        torch.tensor([[v for _, _, v in tokens]]), torch.tensor([prox_version]),
        torch.tensor([progress]))[0]
    for i, (b, c, v) in enumerate(tokens):
        trained_version = prox_version + progress
        if trained_version == v:  # only when the token is current and nothing has moved yet
            expected = b
        else:  # the point at version prox_version on the line through (v, b) and (trained, c)
            expected = b + (c - b) * (prox_version - v) / (trained_version - v)
        assert got[i].item() == pytest.approx(expected, rel=1e-4, abs=1e-4)
        if progress == 0.0 and v < prox_version:  # before the first step π_θ is π_prox
            assert got[i].item() == pytest.approx(c, rel=1e-4, abs=1e-4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(finite, st.booleans()), min_size=1, max_size=16))
def test_whiten_normalises_the_masked_positions(cells):
    values = torch.tensor([[x for x, _ in cells]], dtype=torch.float64)  # near-equal values
    mask = torch.tensor([[m for _, m in cells]])
    got = F.whiten(values, mask)[0].tolist()
    live = [x for x, m in cells if m]
    for (x, m), g in zip(cells, got):
        if not m:
            assert g == 0.0
        else:
            expected = (x - statistics.fmean(live)) / (statistics.pstdev(live) + 1e-8)
            assert g == pytest.approx(expected, rel=1e-3, abs=1e-3)


@given(st.lists(st.tuples(finite, st.lists(st.booleans(), min_size=4, max_size=4)),
                min_size=1, max_size=5))
def test_final_token_rewards_put_each_reward_on_the_last_model_token(rows):
    rewards = torch.tensor([r for r, _ in rows])
    mask = torch.tensor([m for _, m in rows])
    got = F.final_token_rewards(rewards, mask)
    for i, (r, m) in enumerate(rows):
        last = max((t for t in range(4) if m[t]), default=None)
        for t in range(4):
            expected = r if t == last else 0.0
            assert got[i, t].item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_a_positive_entropy_coefficient_raises_the_policys_entropy(aggregation):
    """With zero advantages the policy-gradient term is 0: a step on the loss moves the policy
    only through the entropy term, and with entropy_coef > 0 it must make the policy *more*
    random (a flipped sign would lower it, a dropped term leave it unchanged)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 4, 11, generator=g)).requires_grad_()
    tokens = torch.randint(0, 11, (2, 4), generator=g)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])

    def entropy_of(x):
        logp_all = torch.log_softmax(x, -1)
        return -(logp_all.exp() * logp_all).sum(-1), logp_all.gather(-1, tokens[..., None])[..., 0]

    def masked_mean_entropy():
        with torch.no_grad():
            return (entropy_of(logits)[0] * mask).sum() / mask.sum()

    before = masked_mean_entropy()
    config = GRPOConfig(entropy_coef=0.5, loss=PolicyLossConfig(aggregation=aggregation,
                                                                 recompute_proximal=False))
    optimizer = torch.optim.SGD([logits], lr=5.0)
    for _ in range(5):
        entropy, logp = entropy_of(logits)
        mb = MicroBatch(loss_mask=mask, advantages=torch.zeros(2, 4), logprobs=logp.detach(),
                        versions=torch.ones(2, 4, dtype=torch.long),
                        policy_version=torch.tensor([1, 1]),
                        minibatch_progress=torch.tensor([0.5, 0.5]))
        out = F.actor_loss(ModelOutput(logprobs=logp, entropy=entropy), mb, config)
        optimizer.zero_grad()
        (out.loss_sum / out.normalizer).backward()
        optimizer.step()
    assert masked_mean_entropy() > before + 0.1


# -- defaults, boundaries and statistics (the holes mutation testing found, issue 43) -----------

def test_the_defaults_leave_rewards_alone_and_gae_undiscounted():
    rewards = torch.tensor([-50.0, 0.25, 1e6])
    assert F.scale_rewards(rewards).tolist() == rewards.tolist()  # no scale, bias or clip
    # no discount, no λ (distillation's per-token KL return relies on λ = 1): A_t is the sum of
    # the rewards from t on minus V_t, R_t that sum
    r = torch.tensor([[1.0, 2.0, 4.0, 0.0]])
    v = torch.tensor([[0.5, 0.25, 0.125, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = F.gae(r, v, mask)
    assert adv.tolist() == [[7.0 - 0.5, 6.0 - 0.25, 4.0 - 0.125, 0.0]]
    assert ret.tolist() == [[7.0, 6.0, 4.0, 0.0]]
    # DAPO's soft punishment reaches −1 at max_length and stays there by default
    lengths = torch.tensor([10, 12, 14, 20])
    assert F.overlong_penalty(lengths, max_length=14, cache=4).tolist() == [0.0, -0.5, -1.0, -1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_interpolated_proximal_logprob_keeps_the_logprobs_dtype(dtype):
    behav = torch.tensor([[-1.0, -2.0, -0.5]], dtype=dtype)
    current = torch.tensor([[-0.5, -1.0, -1.5]], dtype=dtype)
    got = F.interpolate_proximal(behav, current, torch.tensor([[0, 1, 2]]), torch.tensor([2]),
                                 torch.tensor([0.5]))
    assert got.dtype == dtype
    # version 2 is current (its behavior logprob); versions 0, 1 lie 2/2.5 and 1/1.5 of the way
    expected = torch.tensor([[-1.0 + 0.8 * 0.5, -2.0 + (2 / 3) * 1.0, -0.5]], dtype=torch.float64)
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=0)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask", "geometric_mask"])
def test_a_ratio_exactly_at_an_end_of_the_band_is_inside_it(mode):
    """The band is closed, [low, high]: r = low and r = high keep their token (and row); a ratio
    just beyond either end drops it."""
    _, drop = F.MISMATCH_CORRECTIONS[mode]
    low, high = 0.5, 2.0
    ratios = torch.tensor([[low], [high], [low * 0.999], [high * 1.001]], dtype=torch.float64)
    known = torch.ones(4, 1, dtype=torch.bool)
    dropped = drop(ratios.log(), known, (low, high))
    assert dropped[:, 0].tolist() == [False, False, True, True]


def test_the_entropy_and_kl_statistics_are_means_per_loss_token():
    """stats["entropy"] and stats["kl_ref"] average over the loss tokens, even for one token."""
    config = GRPOConfig(kl_coef=0.1, entropy_coef=0.01)
    for mask in (torch.tensor([[False, True, False]]),
                 torch.tensor([[True, True, False], [False, True, True]])):
        g = torch.Generator().manual_seed(int(mask.sum()))
        logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * mask
        ref = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * mask
        entropy = torch.rand(mask.shape, generator=g, dtype=torch.float64) * mask
        mb = MicroBatch(loss_mask=mask, logprobs=logp, prox_logprobs=logp, ref_logprobs=ref,
                        advantages=torch.zeros(mask.shape, dtype=torch.float64))
        out = F.actor_loss(ModelOutput(logprobs=logp, entropy=entropy), mb, config)
        cells = [(float(logp[i, j]), float(ref[i, j]), float(entropy[i, j]))
                 for i, j in mask.nonzero().tolist()]
        # on policy (π_θ = π_prox = π_behav) the KL term's value is k3 = e^d − d − 1, d = log q/p
        kl = [math.exp(q - p) - (q - p) - 1 for p, q, _ in cells]
        assert out.stats["entropy"].item() == pytest.approx(statistics.fmean(e for *_, e in cells))
        assert out.stats["kl_ref"].item() == pytest.approx(statistics.fmean(kl))


def test_whiten_divides_by_the_std_plus_eps_even_for_a_tiny_spread():
    values = torch.tensor([[0.0, 2e-8, 5.0]], dtype=torch.float64)
    got = F.whiten(values, torch.tensor([[True, True, False]]))
    # mean 1e-8, std 1e-8: ±1e-8 / (1e-8 + 1e-8)
    torch.testing.assert_close(got, torch.tensor([[-0.5, 0.5, 0.0]], dtype=torch.float64))


def test_the_policy_loss_uses_the_configured_clip_ranges_dual_clip_and_cap():
    """Every option of `PolicyLossConfig` that shapes the surrogate reaches it, seen through the
    per-token loss, its gradient and the stats: ε_low = 0.1, ε_high = 0.3 (not the default 0.2),
    dual clip c = 3 and a behavior-weight cap of 1.5."""
    ratio = torch.tensor([1.25, 1.35, 0.85, 5.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    behav = torch.tensor([0.5, 1.0, 1.0, 1.0, 2.0], dtype=torch.float64).log()  # π_prox = 1
    mask = torch.tensor([[True] * 5 + [False]])
    pad = torch.tensor([[7.0]], dtype=torch.float64)
    logp = torch.cat([ratio.log()[None], pad], 1).requires_grad_()
    mb = MicroBatch(loss_mask=mask, logprobs=torch.cat([behav[None], pad], 1),
                    prox_logprobs=torch.zeros(1, 6, dtype=torch.float64),
                    advantages=torch.cat([adv[None], pad], 1))
    config = PolicyLossConfig(eps_clip=0.1, eps_clip_high=0.3, dual_clip=3.0,
                              importance_weight_cap=1.5)
    loss, stats = F.decoupled_policy_loss(logp, mb, config)
    loss.sum().backward()
    weight = [1.5, 1.0, 1.0, 1.0, 0.5]  # π_prox/π_behav = 2 capped at 1.5, 1, 1, 1, 0.5
    # 1.25 ∈ [0.9, 1.3]: −ρA; 1.35 > 1.3 with A > 0 and 0.85 < 0.9 with A < 0: the clipped
    # ratio, no gradient; ρ = 5 with A < 0: −ρA = 5 bounded by −cA = 3, no gradient; ρ = 1: −A
    expected = [-1.5 * 1.25, -1.3, 0.9, 3.0, 0.5 * -2.0, 0.0]
    torch.testing.assert_close(loss[0], torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(logp.grad[0], torch.tensor([-1.5 * 1.25, 0, 0, 0, -1.0, 0],
                                                          dtype=torch.float64))
    assert stats["clip_fraction"].item() == pytest.approx(3 / 5)
    assert stats["capped_fraction"].item() == pytest.approx(1 / 5)
    assert stats["importance_weight_mean"].item() == pytest.approx(sum(weight) / 5)
    assert stats["importance_weight_max"].item() == pytest.approx(1.5)
    # approx_kl estimates KL(π_behav‖π_θ) as the mean of log π_behav − log π_θ
    approx_kl = statistics.fmean(math.log(b / r) for b, r in
                                 zip([0.5, 1, 1, 1, 2], ratio.tolist()))
    assert stats["approx_kl"].item() == pytest.approx(approx_kl)


def test_a_ratio_exactly_at_the_cap_is_not_counted_as_capped():
    """w = cap exactly is left as it is: neither the behavior weight's `capped` nor the
    mismatch stat `outside_cap_fraction` counts it; just above the cap both do."""
    cap = 2.0
    log_r = torch.tensor([[math.log(cap), math.log(cap) + 1e-6, 0.0]], dtype=torch.float64)
    w, capped = F.importance_weight(log_r, torch.zeros_like(log_r), cap)
    assert w.tolist() == [[cap, cap, 1.0]] and capped.tolist() == [[False, True, False]]
    mb = MicroBatch(loss_mask=torch.ones(1, 3, dtype=torch.bool),
                    logprobs=torch.zeros_like(log_r), prox_logprobs=log_r,
                    advantages=torch.zeros_like(log_r),
                    versions=torch.ones(1, 3, dtype=torch.long), policy_version=torch.tensor([1]))
    config = PolicyLossConfig(mismatch_correction="tis", mismatch_cap=cap)
    *_, stats = F.behavior_weight(log_r, mb, config)
    assert stats["mismatch/outside_cap_fraction"].item() == pytest.approx(1 / 3)


def test_an_empty_micro_batch_has_zero_mismatch_stats():
    empty = torch.zeros(0, 4, dtype=torch.float64)
    mb = MicroBatch(loss_mask=torch.zeros(0, 4, dtype=torch.bool), logprobs=empty,
                    prox_logprobs=empty, advantages=empty,
                    versions=torch.zeros(0, 4, dtype=torch.long),
                    policy_version=torch.zeros(0, dtype=torch.long))
    *_, stats = F.behavior_weight(empty, mb, PolicyLossConfig(mismatch_correction="tis"))
    assert {k: float(v) for k, v in stats.items()} == dict.fromkeys(stats, 0.0)
    assert "mismatch/abs_log_ratio_max" in stats


def test_group_advantages_normalise_by_the_std_by_default():
    rewards, groups = torch.tensor([0.0, 1.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1])
    # mean 0.5, population std 0.5: ±1 (up to eps); a flat group gets 0
    torch.testing.assert_close(F.group_advantages(rewards, groups),
                               torch.tensor([-1.0, 1.0, 0.0, 0.0]), rtol=1e-5, atol=1e-5)


def test_group_advantages_divide_by_the_std_plus_eps_even_for_a_tiny_spread():
    # std 1e-6 = eps: ±1e-6 / (1e-6 + 1e-6)
    got = F.group_advantages(torch.tensor([0.0, 2e-6]), torch.tensor([0, 0]))
    torch.testing.assert_close(got, torch.tensor([-0.5, 0.5]), rtol=1e-3, atol=1e-3)


def test_the_default_clip_range_is_0_2_on_both_sides():
    ratio = torch.tensor([0.75, 0.85, 1.15, 1.25])
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    loss, clipped = F.ppo_surrogate(ratio.log(), torch.zeros(4), adv)
    assert clipped.tolist() == [True, False, False, True]
    torch.testing.assert_close(loss, torch.tensor([0.8, 0.85, -1.15, -1.2]))


def test_a_loss_exactly_at_the_dual_clip_bound_is_not_counted_as_clipped():
    # A < 0: ρ = c = 4 leaves −ρA = −cA as it is; ρ just above is bounded and counted
    logp = torch.tensor([math.log(4.0), math.log(4.0) + 1e-6], dtype=torch.float64)
    loss, clipped = F.ppo_surrogate(logp, torch.zeros(2, dtype=torch.float64),
                                    -torch.ones(2, dtype=torch.float64), dual_clip=4.0)
    assert loss.tolist() == [4.0, 4.0] and clipped.tolist() == [False, True]


# -- adaptive entropy control (issue 40) --------------------------------------------------------

def _sampled_batch(entropy_estimate: float):
    """Two rows whose model tokens' behaviour log-probs average −`entropy_estimate`; the
    prompt positions (off `loss_mask`) hold log-probs that would move the estimate if counted."""
    from tensordict import TensorDict

    mask = torch.tensor([[False, True, True, True], [False, False, True, True]])
    logprobs = torch.where(mask, -entropy_estimate, -50.0)
    return TensorDict({"loss_mask": mask, "logprobs": logprobs, "rewards": torch.tensor([0., 1.]),
                       "group_ids": torch.tensor([0, 0])}, batch_size=[2])


def test_the_adaptive_entropy_coefficient_steps_towards_the_target_and_applies_only_below():
    from areal_flow.algorithms.grpo import GRPO

    grpo = GRPO(GRPOConfig(entropy_target=1.0, entropy_coef_step=0.01))
    assert grpo.needs_entropy_grad and not grpo.skips_zero_advantage_rows
    applied, held = [], []
    for estimate in [0.5, 0.5, 2.0, 2.0, 2.0, 0.5]:
        batch = grpo.advantages(_sampled_batch(estimate))
        assert batch["entropy_coef"].tolist() == [batch["entropy_coef"][0].item()] * 2
        applied.append(round(batch["entropy_coef"][0].item(), 6))
        held.append(round(grpo.entropy_coef, 6))
    assert applied == [0.01, 0.02, 0.0, 0.0, 0.0, 0.01]
    assert held == [0.01, 0.02, 0.01, 0.0, 0.0, 0.01]
    assert "entropy_coef" not in GRPO(GRPOConfig()).advantages(_sampled_batch(0.5)).keys()


@pytest.mark.parametrize("coef", [0.0, 0.3])
def test_the_adaptive_coefficient_trains_as_the_same_fixed_coefficient(coef):
    """GRPO's loss with the batch's `entropy_coef` column gives the gradient that a fixed
    `entropy_coef` of that value gives (and at 0, the gradient without a bonus)."""
    from tensordict import TensorDict
    from areal_flow.algorithms.grpo import GRPO

    g = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(2, 4, 7, generator=g)).requires_grad_()
    tokens = torch.randint(0, 7, (2, 4), generator=g)
    mask = torch.tensor([[False, True, True, True], [False, False, True, True]])
    fields = dict(loss_mask=mask, advantages=torch.tensor([[0., .5, .5, .5], [0., 0., -1., -1.]]),
                  versions=torch.ones(2, 4, dtype=torch.long), policy_version=torch.tensor([1, 1]),
                  minibatch_progress=torch.zeros(2))

    def gradient(grpo, columns=None):
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, tokens[..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        mb = MicroBatch(logprobs=logp.detach() - 0.1, columns=columns, **fields)
        out = grpo.loss(ModelOutput(logprobs=logp, entropy=entropy), mb)
        return torch.autograd.grad(out.loss_sum / out.normalizer, logits)[0]

    loss = PolicyLossConfig(recompute_proximal=False)
    adaptive = GRPO(GRPOConfig(entropy_target=1.0, loss=loss))
    column = TensorDict({"entropy_coef": torch.full((2,), coef)}, batch_size=[2])
    fixed = gradient(GRPO(GRPOConfig(entropy_coef=coef, loss=loss)))
    torch.testing.assert_close(gradient(adaptive, column), fixed)
    if coef:  # the bonus is in the gradient at all
        assert (fixed - gradient(GRPO(GRPOConfig(loss=loss)))).abs().max() > 1e-3
