"""PPO's and GRPO's advantages against references written here, the runtime's role checks, and
the version-based proximal approximation against the recomputed one."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_flow.algorithms.grpo import GRPO, GRPOConfig
from areal_flow.algorithms.ppo import PPO, PPOConfig
from areal_flow.extra_algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig
from areal_flow.config import OptimizerConfig, PolicyLossConfig
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from tests.dist_train_script import fixed_batch

small = st.floats(-3, 3, allow_nan=False, width=32)
pad = st.one_of(small, st.sampled_from([math.inf, -math.inf, math.nan]))  # anything off the mask


@st.composite
def padded(draw, mask):
    """One row: a value where the mask is set, garbage (maybe ±inf, NaN) elsewhere."""
    return [draw(small if m else pad) for m in mask]


@st.composite
def ppo_rows(draw):
    width = draw(st.integers(2, 6))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        mask = draw(st.lists(st.booleans(), min_size=width, max_size=width))
        rows.append((draw(small), mask, draw(padded(mask)), draw(padded(mask)),
                     draw(padded(mask)), draw(st.booleans())))
    return rows


@settings(max_examples=80, deadline=None)
@given(ppo_rows(), st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 0.5), st.booleans())
def test_ppo_advantages_match_a_reference(rows, gamma, lam, beta, bootstrap):
    batch = TensorDict({
        "rewards": torch.tensor([r for r, *_ in rows]),
        "loss_mask": torch.tensor([m for _, m, *_ in rows]),
        "values": torch.tensor([v for _, _, v, _, _, _ in rows]),
        "logprobs": torch.tensor([lp for _, _, _, lp, _, _ in rows]),
        "ref_logprobs": torch.tensor([ref for _, _, _, _, ref, _ in rows]),
        "truncated": torch.tensor([cut for *_, cut in rows]),
    }, batch_size=[len(rows)])
    config = PPOConfig(gamma=gamma, lam=lam, kl_coef=beta, whiten_advantages=False,
                       bootstrap_truncated=bootstrap,
                       loss=PolicyLossConfig(recompute_proximal=False))  # pi_old: the logprobs
    out = PPO(config).advantages(batch.clone())
    for i, (reward, mask, values, logp, ref, cut) in enumerate(rows):
        steps = [t for t, m in enumerate(mask) if m]
        # per-step reward: −β·(log π − log π_ref) on every model token, the reward on the last
        r = {t: -beta * (logp[t] - ref[t]) + (reward if t == steps[-1] else 0.0) for t in steps}
        # V(T+1): 0 at the end of an episode; a cut row may stand in its last step's value
        end = values[steps[-1]] if steps and cut and bootstrap else 0.0
        for k, t in enumerate(steps):
            expected = 0.0
            for offset, u in enumerate(steps[k:]):
                next_value = values[steps[k + offset + 1]] if k + offset + 1 < len(steps) else end
                delta = r[u] + gamma * next_value - values[u]
                expected += (gamma * lam) ** offset * delta
            assert out["advantages"][i, t].item() == pytest.approx(expected, rel=1e-3, abs=1e-3)
            assert out["returns"][i, t].item() == pytest.approx(expected + values[t],
                                                                rel=1e-3, abs=1e-3)
        for t, m in enumerate(mask):
            if not m:
                assert out["advantages"][i, t].item() == 0.0
                assert out["returns"][i, t].item() == 0.0


def test_bootstrapping_truncated_rows_needs_to_know_which_they_are():
    batch = TensorDict({"rewards": torch.ones(1), "loss_mask": torch.ones(1, 2, dtype=torch.bool),
                        "values": torch.zeros(1, 2)}, batch_size=[1])
    with pytest.raises(ValueError, match="'truncated'"):
        PPO(PPOConfig(bootstrap_truncated=True)).advantages(batch)


@st.composite
def grpo_rows(draw):
    """Groups of 1–4 rows; rewards from three values, so that flat groups are common."""
    width = draw(st.integers(1, 4))
    rows = []
    for group in range(draw(st.integers(1, 4))):
        for _ in range(draw(st.integers(1, 4))):
            mask = draw(st.lists(st.booleans(), min_size=width, max_size=width))
            rows.append((group, draw(st.sampled_from([0.0, 0.5, 1.0])), mask,
                         draw(padded(mask)), draw(padded(mask))))
    return draw(st.permutations(rows))


@settings(max_examples=100, deadline=None)
@given(grpo_rows(), st.floats(0.0, 0.5), st.booleans(), st.booleans())
def test_grpo_kl_in_the_advantage_is_centred_in_the_group_and_not_rescaled(
        rows, beta, std_normalize, leave_one_out):
    """A_i = Â(r)_i − β (K_i − baseline_g(K)), K_i = Σ_t (log π − log π_ref): the task reward's
    group advantage (0 for a flat group), plus the KL's own, centred like the reward but not
    divided by the reward's std; `flat_group` marks groups whose task rewards are all equal."""
    batch = TensorDict({
        "group_ids": torch.tensor([g for g, *_ in rows]),
        "rewards": torch.tensor([r for _, r, *_ in rows]),
        "loss_mask": torch.tensor([m for _, _, m, _, _ in rows]),
        "logprobs": torch.tensor([lp for *_, lp, _ in rows]),
        "ref_logprobs": torch.tensor([ref for *_, ref in rows]),
    }, batch_size=[len(rows)])
    config = GRPOConfig(kl_coef=beta, kl_in_reward=True, std_normalize=std_normalize,
                        leave_one_out=leave_one_out,
                        loss=PolicyLossConfig(recompute_proximal=False))  # pi_old: the logprobs
    out = GRPO(config).advantages(batch.clone())
    kl = [sum(lp[t] - ref[t] for t, m in enumerate(mask) if m) for _, _, mask, lp, ref in rows]

    def centred(values, i, members):  # x_i − mean of the group (of the others: leave-one-out)
        others = [values[j] for j in members if j != i or not leave_one_out]
        return values[i] - sum(others) / len(others)

    for i, (group, reward, mask, _, _) in enumerate(rows):
        members = [j for j, row in enumerate(rows) if row[0] == group]
        rewards = [row[1] for row in rows]
        flat = len(set(rewards[j] for j in members)) == 1
        assert bool(out["flat_group"][i]) == flat
        task = 0.0 if flat else centred(rewards, i, members)
        if std_normalize and not flat:
            task /= statistics.pstdev([rewards[j] for j in members]) + 1e-6
        expected = task - beta * (centred(kl, i, members) if len(members) > 1 else 0.0)
        for t, m in enumerate(mask):
            assert out["advantages"][i, t].item() == pytest.approx(
                expected if m else 0.0, rel=1e-3, abs=1e-3)


@pytest.mark.parametrize("make", [
    lambda: GRPO(GRPOConfig(kl_coef=0.3, kl_in_reward=True,
                            loss=PolicyLossConfig(recompute_proximal=True))),
    lambda: PPO(PPOConfig(kl_coef=0.3, loss=PolicyLossConfig(recompute_proximal=True))),
    lambda: ReinforcePP(ReinforcePPConfig(kl_coef=0.3,
                                          loss=PolicyLossConfig(recompute_proximal=True))),
], ids=["grpo", "ppo", "reinforce_pp"])
def test_the_kl_penalty_of_the_advantages_is_of_the_recomputed_proximal_policy(make):
    """With the actor's forward (`prox_logprobs`), the KL penalty in the reward is of π_prox:
    the advantages are those of a batch whose behavior log-probs were π_prox, whatever the
    behavior log-probs are."""
    algorithm = make()
    assert algorithm.roles[0] == "actor" and "ref" in algorithm.roles
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    prox, ref = -torch.rand(4, 4, generator=g), -torch.rand(4, 4, generator=g)
    batch = TensorDict({"group_ids": torch.tensor([0, 0, 1, 1]),
                        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.5]), "loss_mask": mask,
                        "values": torch.rand(4, 4, generator=g), "ref_logprobs": ref},
                       batch_size=[4])
    behaving = batch.clone().update({"logprobs": prox, "prox_logprobs": prox})
    recomputed = batch.clone().update({"logprobs": prox - 1.5, "prox_logprobs": prox})
    expected = algorithm.advantages(behaving)["advantages"]
    assert expected.abs().max() > 0.05
    torch.testing.assert_close(algorithm.advantages(recomputed)["advantages"], expected)


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_missing_role_model_is_named(world, tiny_model_dir):
    trainer = TrainEngine(tiny_model_dir, TrainConfig())
    with pytest.raises(ValueError, match=r"PPO needs a model for the role\(s\) \['critic'\]"):
        trainer.train(fixed_batch(trainer.model.config.vocab_size), PPO())
    with pytest.raises(ValueError, match=r"\['ref'\]"):
        trainer.train(fixed_batch(trainer.model.config.vocab_size),
                      GRPO(GRPOConfig(kl_coef=0.1)))


def stale_batch(vocab: int) -> TensorDict:
    """Rows sampled 1–3 versions before the version being trained (2 → trained is 4)."""
    batch = fixed_batch(vocab)
    g = torch.Generator().manual_seed(1)
    batch["rewards"] = torch.rand(batch.batch_size[0], generator=g)
    batch["logprobs"] = -3 * torch.rand(batch["logprobs"].shape, generator=g)
    batch["versions"] = torch.randint(1, 4, batch["versions"].shape, generator=g)
    batch["policy_version"] = torch.full((batch.batch_size[0],), 4)
    return batch


def test_approximating_proximal_logprobs_equals_recomputing_them_on_the_first_step(
        world, tiny_model_dir):
    results = {}
    for recompute in (True, False):
        trainer = TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2)))
        algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=recompute)))
        stats = trainer.train(stale_batch(trainer.model.config.vocab_size), algorithm)
        results[recompute] = stats, trainer.full_grads()
    (stats_a, grads_a), (stats_b, grads_b) = results[True], results[False]
    assert stats_a["importance_weight_mean"] < 0.5  # the batch really is off-policy (w ≪ 1)
    for key in ("loss", "importance_weight_mean", "capped_fraction", "clip_fraction"):
        assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-4, abs=1e-6), key
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-3, atol=1e-6)


def test_later_minibatches_interpolate_between_behavior_and_current(world, tiny_model_dir):
    """With two optimizer steps per batch the second one's π_prox is an interpolation: log w is
    α·log(π_θ/π_behav) with α = (v_p − v_b)/(v_θ − v_b) ∈ [2/3, 6/7] here, so its weights lie
    well between the recomputed ones (α = 1, w ≈ 0.015 on this batch) and 1 (α = 0)."""
    config = TrainConfig(optim=OptimizerConfig(lr=1e-2), ppo_minibatches=2)
    runs = {}
    for recompute in (True, False):
        trainer = TrainEngine(tiny_model_dir, config)
        algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=recompute)))
        runs[recompute] = trainer.train(stale_batch(trainer.model.config.vocab_size), algorithm)
    recomputed, approximated = (runs[r]["importance_weight_mean"] for r in (True, False))
    assert 1.3 * recomputed < approximated < 0.5  # the mean over both steps
