"""REINFORCE++ (`reinforce_pp`): its advantages against a loop over the definition, its loss's
gradient against the closed form, a 3-step run through the generic recipe on the tiny model,
and its listing by `areal-flow plugins`."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_flow import registry
from areal_flow.extra_algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig
from areal_flow.config import PolicyLossConfig
from areal_flow.types import MicroBatch, ModelOutput
from tests.helpers import metrics, run_cli, run_recipe

WIDTH = 6
# rewards and logprobs on a grid of binary fractions: the float32 sums and returns are exact,
# so a batch whose returns tie (no spread: A = 0) ties in the float64 reference too
reward = st.integers(-4, 4).map(lambda k: k / 4)
groups = st.lists(st.lists(reward, min_size=1, max_size=4), min_size=1, max_size=4)
KL = {"k1": lambda lp, ref: lp - ref, "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
      "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1}


def reference(rows, mask, old, ref, beta, estimator, gamma, baseline):
    """Advantages of every row and position, from the definition, one token at a time."""
    shaped = []
    for g, r in rows:
        group = [s for h, s in rows if h == g]
        flat = max(group) == min(group)  # one row, or all equal: no signal
        shaped.append(r if baseline == "none" else 0.0 if flat else r - sum(group) / len(group))
    returns = {}
    for i, r_hat in enumerate(shaped):
        steps = [t for t in range(WIDTH) if mask[i][t]]
        running = 0.0
        for t in reversed(steps):
            step_reward = -beta * KL[estimator](old[i][t], ref[i][t]) if beta > 0 else 0.0
            running = step_reward + (r_hat if t == steps[-1] else 0.0) + gamma * running
            returns[i, t] = running
    values = list(returns.values())
    if not values or max(values) == min(values):
        return {key: 0.0 for key in returns}, returns
    mean = sum(values) / len(values)
    std = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
    return {key: (x - mean) / (std + 1e-8) for key, x in returns.items()}, returns


@settings(max_examples=150, deadline=None)
@given(groups, st.sampled_from([0.0, 0.5]), st.sampled_from(["k1", "k2", "k3"]),
       st.sampled_from([1.0, 0.5]), st.sampled_from(["none", "group_mean"]), st.booleans(),
       st.integers(0, 2**31))
def test_advantages_match_a_loop(groups, beta, estimator, gamma, baseline, recomputed, seed):
    rows = [(g, r) for g, group in enumerate(groups) for r in group]
    n = len(rows)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, WIDTH, generator=gen) < 0.6  # gaps: environment tokens between turns
    grid = lambda: -torch.randint(0, 17, (n, WIDTH), generator=gen) / 8  # noqa: E731
    behav, prox, ref = grid(), grid(), grid()
    behav[~mask], prox[~mask], ref[~mask] = math.nan, -math.inf, math.inf  # pads: anything
    batch = TensorDict({"rewards": torch.tensor([r for _, r in rows]),
                        "group_ids": torch.tensor([g for g, _ in rows]), "loss_mask": mask,
                        "logprobs": behav, "ref_logprobs": ref}, batch_size=[n])
    if recomputed:
        batch["prox_logprobs"] = prox
    config = ReinforcePPConfig(kl_coef=beta, kl_estimator=estimator, gamma=gamma,
                               baseline=baseline,
                               loss=PolicyLossConfig(recompute_proximal=recomputed))
    out = ReinforcePP(config).advantages(batch)
    old = (prox if recomputed else behav).tolist()
    want, returns = reference(rows, mask.tolist(), old, ref.tolist(), beta, estimator, gamma,
                              baseline)
    for i in range(n):
        for t in range(WIDTH):
            assert out["returns"][i, t].item() == pytest.approx(returns.get((i, t), 0.0),
                                                                abs=1e-5)
            assert out["advantages"][i, t].item() == pytest.approx(want.get((i, t), 0.0),
                                                                   rel=1e-3, abs=2e-3)


@pytest.mark.parametrize("baseline", ["none", "group_mean"])
def test_a_batch_without_spread_gets_exactly_zero(baseline):
    """Equal returns everywhere (β = 0, γ = 1, one reward): whitening would blow their float32
    rounding up to advantages of order 1 (0.43 for 0.1); they are exactly 0, and skipped."""
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[:, :2] = False
    batch = TensorDict({"rewards": torch.full((6,), 0.1), "group_ids": torch.arange(6) // 2,
                        "loss_mask": mask, "logprobs": -torch.rand(6, 7)}, batch_size=[6])
    config = ReinforcePPConfig(kl_coef=0.0, baseline=baseline)
    assert (ReinforcePP(config).advantages(batch)["advantages"] == 0).all()


def test_loss_gradient_is_the_weighted_surrogate_until_the_clip():
    # tokens (row 0): A > 0 at ρ = 1;  A > 0, ρ = e^0.5 > 1.2 (clipped);  A < 0, ρ = e^-0.5 < 0.8
    # (clipped);  A < 0, ρ = e^0.3 > 1.2 (not clipped: the loss of a bad token keeps growing);
    # (row 1): A > 0, ρ = e^-0.5 < 0.8 (not clipped), with w = e^2 capped at 5;  A = 0;  pads
    mask = torch.tensor([[False, True, True, True, True], [False, True, True, False, False]])
    adv = torch.tensor([[0.0, 1.5, 2.0, -1.0, -0.5], [0.0, 0.7, 0.0, 0.0, 0.0]])
    behav = torch.tensor([[math.inf, -1.0, -2.0, -1.5, -0.5],
                          [math.nan, -3.0, -1.0, 9.0, -math.inf]])
    prox = behav + torch.tensor([[0.0, 0.1, -0.2, 0.0, 0.3], [0.0, 2.0, 0.0, 0.0, 0.0]])
    delta = torch.tensor([[0.0, 0.0, 0.5, -0.5, 0.3], [0.0, -0.5, 0.0, 0.0, 0.0]])
    ref = torch.tensor([[0.0, -1.2, -1.8, -2.0, -0.4], [0.0, -3.5, -1.0, 0.0, 0.0]])
    logp = torch.where(mask, prox + delta, 0.0).requires_grad_()  # 0 off the mask, as the runtime
    mb = MicroBatch(loss_mask=mask, advantages=adv, logprobs=behav, prox_logprobs=prox,
                    ref_logprobs=ref)
    result = ReinforcePP(ReinforcePPConfig(kl_coef=0.1)).loss(ModelOutput(logprobs=logp), mb)
    result.loss_sum.backward()

    rho, w = delta.exp(), torch.where(mask, prox - behav, 0.0).exp().clamp(max=5.0)
    active = torch.tensor([[0, 1, 0, 0, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)  # not clipped
    # d/d log π of w·(−ρA) is −wρA where the unclipped branch is the max, else 0 (constant)
    torch.testing.assert_close(logp.grad, torch.where(active, -w * rho * adv, 0.0))
    clipped = rho.clamp(0.8, 1.2)
    per_token = w * torch.maximum(-rho * adv, -clipped * adv)
    assert result.loss_sum.item() == pytest.approx(per_token[mask].sum().item())
    assert (result.normalizer, result.unit) == (6.0, "tokens")
    assert result.stats["clip_fraction"].item() == pytest.approx(2 / 6)
    kl = (logp.detach() - ref)[mask].mean()  # k1 of π_θ against π_ref on the sampled tokens
    assert result.stats["kl_ref"].item() == pytest.approx(kl.item())


def test_config_roles_and_validation():
    assert ReinforcePP().roles == ("actor", "ref")
    no_kl = ReinforcePP(ReinforcePPConfig(kl_coef=0.0))
    assert no_kl.roles == ("actor",) and no_kl.min_group_size == 1
    assert ReinforcePP(ReinforcePPConfig(baseline="group_mean")).min_group_size == 2
    for bad in ({"kl_coef": -0.1}, {"gamma": 1.5}, {"baseline": "mean"},
                {"kl_estimator": "k4"}, {"loss": 0.2}):
        with pytest.raises((ValueError, TypeError)):
            ReinforcePPConfig(**bad)


def test_trains_three_steps_through_the_recipe_with_a_kl_penalty(
        tiny_model_dir, gsm8k_file, tmp_path):
    run_dir = tmp_path / "run"
    run_recipe("gsm8k_grpo.py", [
        "--model", str(tiny_model_dir), "--dataset", str(gsm8k_file), "--run-dir", str(run_dir),
        "--steps", "3", "--eval-size", "0", "--rollout.batch-size", "2",
        "--rollout.group-size", "2", "--sampling.max-new-tokens", "8",
        "--inference.dtype", "float32", "--train.dtype", "float32", "--train.optim.lr", "1e-3",
        "--algorithm", "reinforce_pp", "--algorithm.kl-coef", "0.05",
        "--algorithm.baseline", "group_mean",
        "--reward", "tests.rewards_for_tests:completion_length"])
    trained = [m for m in metrics(run_dir) if m["step"] > 0]
    assert len(trained) == 3, trained
    for m in trained:
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0, m
        assert math.isfinite(m["kl_ref"]) and "clip_fraction" in m, m
    config = (run_dir / "config.yaml").read_text()
    assert "algorithm_name: reinforce_pp" in config and "kl_coef: 0.05" in config
    assert "baseline: group_mean" in config


def test_areal_flow_plugins_lists_it_and_the_registry_resolves_it():
    listing = run_cli("plugins").stdout.splitlines()
    cells = [[c.strip() for c in row.strip("│ ").split("│")] for row in listing
             if "reinforce_pp" in row]
    assert cells == [["algorithm", "reinforce_pp", "areal-flow 0.1.0",
                      "areal_flow.extra_algorithms.reinforce_pp:ReinforcePP"]], listing
    spec = registry.algorithms.spec("reinforce_pp")
    assert (spec.cls, spec.config) == (ReinforcePP, ReinforcePPConfig)
