"""PPO's advantages against a reference written here, the runtime's role checks, and the
version-based proximal approximation against the recomputed one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_flow.algorithms.grpo import GRPO, GRPOConfig
from areal_flow.algorithms.ppo import PPO, PPOConfig
from areal_flow.config import OptimizerConfig, PolicyLossConfig
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from tests.dist_train_script import fixed_batch

small = st.floats(-3, 3, allow_nan=False, width=32)


@st.composite
def ppo_rows(draw):
    width = draw(st.integers(2, 6))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        mask = draw(st.lists(st.booleans(), min_size=width, max_size=width))
        rows.append((draw(small), mask, [draw(small) for _ in range(width)],
                     [draw(small) for _ in range(width)], [draw(small) for _ in range(width)]))
    return rows


@settings(max_examples=80, deadline=None)
@given(ppo_rows(), st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 0.5))
def test_ppo_advantages_match_a_reference(rows, gamma, lam, beta):
    batch = TensorDict({
        "rewards": torch.tensor([r for r, *_ in rows]),
        "loss_mask": torch.tensor([m for _, m, *_ in rows]),
        "values": torch.tensor([v for *_, v, _, _ in rows]),
        "logprobs": torch.tensor([lp for *_, lp, _ in rows]),
        "ref_logprobs": torch.tensor([ref for *_, ref in rows]),
    }, batch_size=[len(rows)])
    config = PPOConfig(gamma=gamma, lam=lam, kl_coef=beta, whiten_advantages=False)
    out = PPO(config).advantages(batch.clone())
    for i, (reward, mask, values, logp, ref) in enumerate(rows):
        steps = [t for t, m in enumerate(mask) if m]
        # per-step reward: −β·(log π − log π_ref) on every model token, the reward on the last
        r = {t: -beta * (logp[t] - ref[t]) + (reward if t == steps[-1] else 0.0) for t in steps}
        for k, t in enumerate(steps):
            expected = 0.0
            for offset, u in enumerate(steps[k:]):
                next_value = values[steps[k + offset + 1]] if k + offset + 1 < len(steps) else 0
                delta = r[u] + gamma * next_value - values[u]
                expected += (gamma * lam) ** offset * delta
            assert out["advantages"][i, t].item() == pytest.approx(expected, rel=1e-3, abs=1e-3)
            assert out["returns"][i, t].item() == pytest.approx(expected + values[t],
                                                                rel=1e-3, abs=1e-3)
        for t, m in enumerate(mask):
            if not m:
                assert out["advantages"][i, t].item() == 0.0


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
    assert stats_a["importance_weight_mean"] != 1.0  # the batch really is off-policy
    for key in ("loss", "importance_weight_mean", "capped_fraction", "clip_fraction"):
        assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-4, abs=1e-6), key
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-3, atol=1e-6)


def test_later_minibatches_interpolate_between_behavior_and_current(world, tiny_model_dir):
    """With two optimizer steps per batch the second one's π_prox is an interpolation: its
    weights are neither the behavior ones (w = 1) nor the recomputed ones."""
    config = TrainConfig(optim=OptimizerConfig(lr=1e-2), ppo_minibatches=2)
    runs = {}
    for recompute in (True, False):
        trainer = TrainEngine(tiny_model_dir, config)
        algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=recompute)))
        runs[recompute] = trainer.train(stale_batch(trainer.model.config.vocab_size), algorithm)
    assert runs[False]["importance_weight_mean"] != pytest.approx(
        runs[True]["importance_weight_mean"], rel=1e-6)
