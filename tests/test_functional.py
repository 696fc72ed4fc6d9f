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
from areal_flow.types import ModelOutput

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
        mb = {"loss_mask": torch.tensor([[True]]), "logprobs": one_token(behav[y]),
              "prox_logprobs": one_token(prox[y]), "ref_logprobs": one_token(ref[y]),
              "advantages": torch.zeros(1, 1, dtype=torch.float64)}
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
    config = GRPOConfig(kl_coef=0.1, entropy_coef=0.01,
                        loss=PolicyLossConfig(aggregation=aggregation))
    results = []
    for pad in (0.0, garbage):
        x = {key: torch.where(mask, t, pad) for key, t in clean.items()}
        logp, entropy = x.pop("logp").requires_grad_(), x.pop("entropy").requires_grad_()
        mb = {"loss_mask": mask, "versions": torch.tensor([[1, 2, -1], [2, -1, -1]]),
              "policy_version": torch.tensor([2, 2]),
              "minibatch_progress": torch.tensor([0.5, 0.5]), **x}
        if not recompute:
            del mb["prox_logprobs"]
        out = F.actor_loss(ModelOutput(logprobs=logp, entropy=entropy), mb, config)
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
    config = GRPOConfig(entropy_coef=0.5, loss=PolicyLossConfig(aggregation=aggregation))
    optimizer = torch.optim.SGD([logits], lr=5.0)
    for _ in range(5):
        entropy, logp = entropy_of(logits)
        mb = {"loss_mask": mask, "advantages": torch.zeros(2, 4),
              "logprobs": logp.detach(), "versions": torch.ones(2, 4, dtype=torch.long),
              "policy_version": torch.tensor([1, 1]),
              "minibatch_progress": torch.tensor([0.5, 0.5])}
        out = F.actor_loss(ModelOutput(logprobs=logp, entropy=entropy), mb, config)
        optimizer.zero_grad()
        (out.loss_sum / out.normalizer).backward()
        optimizer.step()
    assert masked_mean_entropy() > before + 0.1
