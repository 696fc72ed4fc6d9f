"""Rollout/training mismatch: the `mismatch/...` metrics and the corrections (TIS, token /
sequence / geometric masks) against references written here with loops over the definitions."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_flow.algorithms import functional as F
from areal_flow.algorithms.grpo import GRPO, GRPOConfig
from areal_flow.algorithms.ppo import PPO, PPOConfig
from areal_flow.config import OptimizerConfig, PolicyLossConfig
from areal_flow.types import MicroBatch, ModelOutput

MODES = ["none", "tis", "token_mask", "sequence_mask", "geometric_mask"]
PV = 3  # the policy version being trained in the hand-built batches


# ------------------------------------------------------------------ the reference, as loops


def reference(rows, *, mode, cap, tis_cap, band, recompute, progress, eps=0.2):
    """Per-token loss, weight and kept flag, and the metrics, for `rows` = lists of tokens
    (mask, version, behav, prox, logp, adv), straight from the definitions."""
    low, high = band
    tokens = {}  # (i, t) -> dict
    for i, row in enumerate(rows):
        for t, (m, v, behav, prox, logp, adv) in enumerate(row):
            if not m:
                continue
            if not recompute:  # interpolate_proximal: log-linear in versions
                span = PV + progress - v
                prox = behav + ((PV - v) / span if span > 0 else 0.0) * (logp - behav)
            known = v == PV and (recompute or progress == 0)
            train = (row[t][3] if recompute else logp) if known else None
            tokens[i, t] = dict(known=known, behav=behav, prox=prox, logp=logp, adv=adv,
                                r=math.exp(train - behav) if known else None, train=train)
    for (i, t), x in tokens.items():
        if mode == "tis" and x["known"]:
            x["prox"] = x["train"]
            x["w"] = min(x["r"], tis_cap)
        else:
            raw = math.exp(x["prox"] - x["behav"])
            x["w"] = raw if cap is None else min(raw, cap)
    for i in range(len(rows)):
        mine = [x for (j, _), x in tokens.items() if j == i]
        known = [x for x in mine if x["known"]]
        outside = [not low <= x["r"] <= high for x in known]
        geo = math.exp(sum(math.log(x["r"]) for x in known) / len(known)) if known else 1.0
        for x in mine:
            x["keep"] = {"token_mask": not (x["known"] and not low <= x["r"] <= high),
                         "sequence_mask": not any(outside),
                         "geometric_mask": low <= geo <= high}.get(mode, True)
    for x in tokens.values():
        rho = math.exp(x["logp"] - x["prox"])
        surrogate = max(-rho * x["adv"], -min(max(rho, 1 - eps), 1 + eps) * x["adv"])
        x["loss"] = x["w"] * surrogate if x["keep"] else 0.0
    known = [x for x in tokens.values() if x["known"]]
    sizes = [abs(math.log(x["r"])) for x in known]
    n = max(len(tokens), 1)
    metrics = {
        "mismatch/measured_fraction": len(known) / n,
        "mismatch/abs_log_ratio_mean": sum(sizes) / max(len(known), 1),
        "mismatch/abs_log_ratio_max": max(sizes, default=0.0),
        "mismatch/outside_cap_fraction":
            sum(not 1 / tis_cap <= x["r"] <= tis_cap for x in known) / max(len(known), 1),
        "mismatch/masked_fraction": sum(not x["keep"] for x in tokens.values()) / n,
    }
    return tokens, metrics


def near_a_bound(rows, band, tis_cap, recompute):
    """Whether some ratio π_train/π_rollout sits on a band edge, where float rounding decides."""
    edges = [math.log(b) for b in (*band, tis_cap, 1 / tis_cap)]
    for row in rows:
        logs = [(p if recompute else lp) - b for m, v, b, p, lp, _ in row if m and v == PV]
        for x in logs + ([sum(logs) / len(logs)] if logs else []):
            if any(abs(x - e) < 1e-6 for e in edges):
                return True
    return False


def to_mb(rows, *, recompute, progress, pad=0.0):
    """A micro-batch of `rows`, with `pad` on every padded position."""
    width = max(len(r) for r in rows)
    mask = torch.tensor([[tok[0] for tok in r] + [False] * (width - len(r)) for r in rows])

    def column(k, dtype=torch.float64):
        values = torch.tensor([[tok[k] for tok in r] + [0] * (width - len(r)) for r in rows],
                              dtype=dtype)
        return values if dtype != torch.float64 else torch.where(mask, values, pad)

    mb = {"loss_mask": mask, "versions": torch.where(mask, column(1, torch.long), -1),
          "logprobs": column(2), "prox_logprobs": column(3), "advantages": column(5),
          "policy_version": torch.full((len(rows),), PV),
          "minibatch_progress": torch.full((len(rows),), float(progress))}
    if not recompute:
        del mb["prox_logprobs"]
    return MicroBatch(**mb), column(4).requires_grad_()


delta = st.floats(-1.5, 1.5, allow_nan=False)


@st.composite
def token_rows(draw):
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        row = []
        for _ in range(draw(st.integers(1, 6))):
            behav = draw(st.floats(-4, 0))
            prox = behav + draw(delta)
            logp = prox + draw(st.floats(-0.5, 0.5))
            row.append((draw(st.booleans()), draw(st.sampled_from([PV - 2, PV - 1, PV, PV])),
                        behav, prox, logp, draw(st.floats(-2, 2))))
        rows.append(row)
    return rows


@settings(max_examples=300, deadline=None)
@given(token_rows(), st.sampled_from(MODES), st.sampled_from([None, 1.5, 5.0]),
       st.sampled_from([1.5, 2.0, 5.0]), st.sampled_from([(0.5, 2.0), (0.8, 1.25), (0.2, 5.0)]),
       st.booleans(), st.sampled_from([0.0, 0.5]),
       st.sampled_from([0.0, math.inf, -math.inf, math.nan, 1e30]))
def test_loss_and_metrics_match_the_reference(rows, mode, cap, tis_cap, band, recompute,
                                              progress, pad):
    assume(not near_a_bound(rows, band, tis_cap, recompute))
    config = PolicyLossConfig(mismatch_correction=mode, importance_weight_cap=cap,
                              mismatch_cap=tis_cap, mismatch_band=band,
                              recompute_proximal=recompute)
    mb, logp = to_mb(rows, recompute=recompute, progress=progress, pad=pad)
    per_token, stats = F.decoupled_policy_loss(logp, mb, config)
    tokens, metrics = reference(rows, mode=mode, cap=cap, tis_cap=tis_cap, band=band,
                                recompute=recompute, progress=progress)
    for i, row in enumerate(rows):
        for t in range(per_token.shape[1]):
            want = tokens[i, t]["loss"] if (i, t) in tokens else 0.0
            assert per_token[i, t].item() == pytest.approx(want, rel=1e-9, abs=1e-12), (i, t)
    for key, want in metrics.items():  # (fractions of token counts come in float32)
        assert stats[key].item() == pytest.approx(want, rel=1e-6, abs=1e-12), key
    n = max(len(tokens), 1)
    weights = sum(x["w"] * x["keep"] for x in tokens.values()) / n
    assert stats["importance_weight_mean"].item() == pytest.approx(weights, rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------ gradients


def grad_of(mb, logp, config):
    per_token, _ = F.decoupled_policy_loss(logp, mb, config)
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    return per_token.detach(), grad


#   row 0: log r = 0, 0.9, 0.1      token: drops t1   sequence: drops the row   geometric: keeps
#   row 1: log r = 0.8, 0.7, 0.65   token: drops t0, t1  sequence, geometric (mean 0.717): drop
#   row 2: log r = 0.6, 0.6, -0.6   nothing is outside (ln 2 = 0.693)
#   row 3: a stale token (log w = 3) and a known one at 0: the stale one is never outside
MASK_ROWS = [[0.0, 0.9, 0.1], [0.8, 0.7, 0.65], [0.6, 0.6, -0.6], [3.0, 0.0, None]]
DROPPED = {"token_mask": {(0, 1), (1, 0), (1, 1)},
           "sequence_mask": {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)},
           "geometric_mask": {(1, 0), (1, 1), (1, 2)}}


def mask_batch(recompute):
    rows = []
    for r, logs in enumerate(MASK_ROWS):
        row = []
        for t, log_r in enumerate(logs):
            if log_r is None:
                row.append((False, -1, 0.0, 0.0, 0.0, 0.0))
                continue
            behav = -1.0 - 0.1 * t
            stale = r == 3 and t == 0
            # logp inside the clip range of prox (recompute) so every kept token has a gradient
            prox = behav + log_r
            logp = prox + 0.05 if recompute else behav + log_r
            # A < 0: a ratio above 1 is not clipped, so every dropped token had a gradient
            row.append((True, PV - 1 if stale else PV, behav, prox, logp, -1.0 + 0.3 * t))
        rows.append(row)
    return to_mb(rows, recompute=recompute, progress=0.0)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask", "geometric_mask"])
def test_masked_tokens_get_zero_loss_and_gradient_and_the_rest_are_untouched(mode, recompute):
    mb, logp = mask_batch(recompute)
    base = PolicyLossConfig(mismatch_band=(0.5, 2.0), recompute_proximal=recompute)
    loss_none, grad_none = grad_of(mb, logp, base)
    loss, grad = grad_of(mb, logp, attrs.evolve(base, mismatch_correction=mode))
    mask = mb.loss_mask
    dropped = torch.zeros_like(mask)
    for i, t in DROPPED[mode]:
        dropped[i, t] = True
    assert (grad_none[dropped] != 0).all()  # they would have moved
    assert (grad[dropped] == 0).all() and (loss[dropped] == 0).all()
    kept = mask & ~dropped
    torch.testing.assert_close(grad[kept], grad_none[kept], rtol=0, atol=0)
    torch.testing.assert_close(loss[kept], loss_none[kept], rtol=0, atol=0)
    _, stats = F.decoupled_policy_loss(logp, mb, attrs.evolve(base, mismatch_correction=mode))
    assert stats["mismatch/masked_fraction"].item() == pytest.approx(len(DROPPED[mode]) / 11)
    # the KL term in the loss carries the same weight: with A = 0 it is all there is
    mb = attrs.evolve(mb, advantages=torch.zeros_like(mb.advantages),
                      ref_logprobs=mb.logprobs - 0.3)
    grads = {}
    for m in ("none", mode):
        x = logp.detach().clone().requires_grad_()
        config = GRPOConfig(kl_coef=0.5, loss=PolicyLossConfig(mismatch_correction=m,
                                                               recompute_proximal=recompute))
        F.actor_loss(ModelOutput(logprobs=x), mb, config).loss_sum.backward()
        grads[m] = x.grad
    assert (grads["none"][dropped] != 0).all() and (grads[mode][dropped] == 0).all()
    torch.testing.assert_close(grads[mode][kept], grads["none"][kept], rtol=0, atol=0)


@pytest.mark.parametrize("recompute", [True, False])
def test_tis_scales_the_gradient_by_the_truncated_ratio_without_differentiating_it(recompute):
    """d L/d log π_θ = −min(r, C)·ρ·A on known tokens inside the clip range (ρ = 1 before the
    first step without recompute: π_prox := π_θ); stale tokens keep the decoupled weight."""
    # r < 1, 1 < r < C, r > C (C = 2), and a stale token whose π_prox/π_behav = e > C
    log_r = [-0.5, 0.3, 1.2, 1.0]
    rows = [[(True, PV if t < 3 else PV - 1, -1.0, -1.0 + lr,
              -1.0 + lr + (0.1 if recompute else 0.0), 0.7) for t, lr in enumerate(log_r)]]
    mb, logp = to_mb(rows, recompute=recompute, progress=0.0)
    config = PolicyLossConfig(mismatch_correction="tis", mismatch_cap=2.0,
                              recompute_proximal=recompute)
    loss, grad = grad_of(mb, logp, config)
    _, grad_none = grad_of(mb, logp, PolicyLossConfig(recompute_proximal=recompute))
    rho = math.exp(0.1) if recompute else 1.0  # without recompute, π_prox = π_θ at step one
    for t, lr in enumerate(log_r):
        w = min(math.exp(lr), 2.0) if t < 3 else math.e  # stale: the decoupled weight, cap 5
        assert grad[0, t].item() == pytest.approx(-w * rho * 0.7, rel=1e-9)
        assert loss[0, t].item() == pytest.approx(-w * rho * 0.7, rel=1e-9)
    assert grad[0, 3].item() == grad_none[0, 3].item()


# ------------------------------------------------------------------ no-op and garbage


def random_batch(seed, *, recompute, identical):
    """Fresh and stale tokens; with `identical`, π_train = π_rollout on every known token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 6, generator=g) < 0.8
    versions = torch.where(mask, torch.randint(PV - 1, PV + 1, (3, 6), generator=g), -1)
    behav = -3 * torch.rand(3, 6, generator=g, dtype=torch.float64)
    prox = behav + torch.randn(3, 6, generator=g, dtype=torch.float64)
    logp = prox + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    fresh = versions == PV
    if identical:
        behav = torch.where(fresh, prox if recompute else logp, behav)
    mb = {"loss_mask": mask, "versions": versions, "logprobs": behav, "prox_logprobs": prox,
          "ref_logprobs": behav - 0.2 * torch.rand(3, 6, generator=g, dtype=torch.float64),
          "advantages": torch.randn(3, 6, generator=g, dtype=torch.float64),
          "policy_version": torch.full((3,), PV), "minibatch_progress": torch.zeros(3)}
    if not recompute:
        del mb["prox_logprobs"]
    entropy = torch.rand(3, 6, generator=g, dtype=torch.float64)
    return MicroBatch(**mb), torch.where(mask, logp, 0.0), torch.where(mask, entropy, 0.0)


def actor(mb, logp, entropy, mode, recompute, aggregation="token"):
    config = GRPOConfig(kl_coef=0.1, entropy_coef=0.01, loss=PolicyLossConfig(
        mismatch_correction=mode, aggregation=aggregation, mismatch_cap=1.5,
        mismatch_band=(0.9, 1.1), recompute_proximal=recompute))
    logp, entropy = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    out = F.actor_loss(ModelOutput(logprobs=logp, entropy=entropy), mb, config)
    out.loss_sum.backward()
    return out, logp.grad, entropy.grad


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("mode", MODES[1:])
def test_every_correction_is_a_no_op_when_train_and_rollout_agree(mode, recompute, seed):
    mb, logp, entropy = random_batch(seed, recompute=recompute, identical=True)
    base, grad, _ = actor(mb, logp, entropy, "none", recompute)
    out, got, _ = actor(mb, logp, entropy, mode, recompute)
    assert out.loss_sum.item() == pytest.approx(base.loss_sum.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(got, grad, rtol=1e-12, atol=1e-15)
    assert out.stats["mismatch/abs_log_ratio_max"].item() == 0.0
    # and they are not when the two disagree (tight band, small cap: every option acts)
    mb, logp, entropy = random_batch(seed, recompute=recompute, identical=False)
    base, grad, _ = actor(mb, logp, entropy, "none", recompute)
    _, got, _ = actor(mb, logp, entropy, mode, recompute)
    assert not torch.allclose(got, grad)


@pytest.mark.parametrize("garbage", [math.inf, -math.inf, 1e30, math.nan])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_garbage_at_padded_positions_changes_nothing(mode, recompute, garbage):
    mb, logp, entropy = random_batch(7, recompute=recompute, identical=False)
    mask = mb.loss_mask
    results = []
    for pad in (0.0, garbage):
        dirty = attrs.evolve(mb, **{k: torch.where(mask, v, pad) for k, v in attrs.asdict(
            mb, recurse=False).items() if v is not None and v.dtype == torch.float64})
        out, grad, egrad = actor(dirty, torch.where(mask, logp, pad),
                                 torch.where(mask, entropy, pad), mode, recompute,
                                 aggregation="sequence")
        assert all(math.isfinite(float(v)) for v in out.stats.values()), out.stats
        assert (grad[~mask] == 0).all() and (egrad[~mask] == 0).all()
        results.append((out.loss_sum.detach(), grad, {k: float(v) for k, v in out.stats.items()}))
    (loss0, grad0, stats0), (loss1, grad1, stats1) = results
    torch.testing.assert_close(loss1, loss0)
    torch.testing.assert_close(grad1, grad0)
    assert stats1 == stats0


# ------------------------------------------------------------------ wiring and config


@pytest.mark.parametrize("algorithm", [GRPO(), PPO(PPOConfig(kl_in_reward=False, kl_coef=0.1))])
def test_grpo_and_ppo_report_the_mismatch_every_step(algorithm):
    mb, logp, entropy = random_batch(3, recompute=True, identical=False)
    out = algorithm.loss(ModelOutput(logprobs=logp, entropy=entropy), mb)
    fresh = mb.loss_mask & (mb.versions == PV)
    size = (mb.prox_logprobs - mb.logprobs)[fresh].abs()
    assert out.stats["mismatch/measured_fraction"].item() == pytest.approx(
        fresh.sum().item() / mb.loss_mask.sum().item())
    assert out.stats["mismatch/abs_log_ratio_mean"].item() == pytest.approx(size.mean().item())
    assert out.stats["mismatch/abs_log_ratio_max"].item() == pytest.approx(size.max().item())


def test_a_correction_without_versions_is_refused_and_none_measures_nothing():
    mb, logp, _ = random_batch(0, recompute=True, identical=False)
    mb = attrs.evolve(mb, versions=None)
    _, stats = F.decoupled_policy_loss(logp, mb, PolicyLossConfig())
    assert stats["mismatch/measured_fraction"].item() == 0.0
    with pytest.raises(ValueError, match="'versions' and 'policy_version'"):
        F.decoupled_policy_loss(logp, mb, PolicyLossConfig(mismatch_correction="tis"))


def test_the_loss_config_not_the_rows_decides_where_pi_prox_comes_from():
    """recompute_proximal=True with no actor forward in the rows (an algorithm whose roles lack
    `actor`) is refused, naming the fix, where it was silently interpolated; with it False, a
    prox_logprobs the rows happen to carry is not used."""
    with_prox, logp, _ = random_batch(5, recompute=True, identical=False)
    without = attrs.evolve(with_prox, prox_logprobs=None)
    batch = TensorDict({"loss_mask": without.loss_mask, "logprobs": without.logprobs,
                        "ref_logprobs": without.ref_logprobs}, batch_size=[3])
    for call in (lambda: F.decoupled_policy_loss(logp, without, PolicyLossConfig()),
                 lambda: F.reference_kl(batch, "k1", PolicyLossConfig())):
        with pytest.raises(ValueError, match="actor role"):
            call()
    interpolate = PolicyLossConfig(recompute_proximal=False)
    want, _ = F.decoupled_policy_loss(logp, without, interpolate)
    got, _ = F.decoupled_policy_loss(logp, with_prox, interpolate)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    recomputed, _ = F.decoupled_policy_loss(logp, with_prox, PolicyLossConfig())
    assert not torch.allclose(recomputed, want)  # the two sources differ on this batch
    torch.testing.assert_close(F.reference_kl(batch, "k1", interpolate),
                               F.masked(batch["logprobs"] - batch["ref_logprobs"],
                                        batch["loss_mask"]))


def test_a_micro_batch_of_a_batch_types_the_known_keys_and_keeps_the_rest_as_columns():
    batch = TensorDict({"loss_mask": torch.ones(2, 3, dtype=torch.bool),
                        "ref_logprobs": torch.zeros(2, 3), "chosen": torch.tensor([True, False])},
                       batch_size=[2])
    mb = MicroBatch.of(batch)
    assert mb.ref_logprobs is batch["ref_logprobs"] and mb.prox_logprobs is None
    assert set(mb.columns.keys()) == {"chosen"} and mb.columns["chosen"].tolist() == [True, False]


def test_every_role_fills_a_micro_batch_field_and_a_wrong_field_is_refused():
    import typing

    from areal_flow.types import ROLES, Role, RoleForward

    assert set(ROLES) == set(typing.get_args(Role))
    for not_a_field in ("ref_logprob", "columns"):
        with pytest.raises(ValueError, match=f"'fills' must be in .*'ref_logprobs'.*"
                                             f"\\(got '{not_a_field}'\\)"):
            RoleForward(not_a_field, "logprobs")


def test_every_option_of_the_config_has_its_correction():
    import typing

    choices = typing.get_args(typing.get_type_hints(PolicyLossConfig)["mismatch_correction"])
    assert set(choices) == set(F.MISMATCH_CORRECTIONS) == {*MODES, "auto"}
    # auto reaches a loss only unresolved (no recipe chose): it is none's correction
    assert F.MISMATCH_CORRECTIONS["auto"] == F.MISMATCH_CORRECTIONS["none"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mismatch_correction": "clip"}, "'mismatch_correction' must be in"),
    ({"mismatch_cap": 1.0}, "'mismatch_cap' must be > 1.0"),
    ({"mismatch_band": (1.0, 2.0)}, "0 < low < 1 < high"),
    ({"mismatch_band": (0.5, 0.9)}, "0 < low < 1 < high"),
    ({"mismatch_band": (0.0, 2.0)}, "0 < low < 1 < high"),
])
def test_bad_options_fail_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


# ------------------------------------------------------------------ the runtime's versions


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("recompute", [True, False])
def test_the_metric_compares_only_weights_the_rollout_used(world, tiny_model_dir, recompute):
    """Behavior logprobs = the trainer's own ± 0.1 on every token of the version being trained,
    two optimizer steps per batch (lr 1e-2: the second step's weights have moved). Recomputed:
    every token is measured on both steps, at exactly 0.1. Approximated: the first step measures
    0.1, the second measures nothing (its π_θ is no longer the rollout's weights)."""
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from tests.dist_train_script import fixed_batch

    torch.manual_seed(0)
    trainer = TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2),
                                                      ppo_minibatches=2))
    batch = fixed_batch(trainer.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    batch["rewards"] = torch.rand(batch.batch_size[0], generator=g)
    batch["policy_version"] = torch.zeros(batch.batch_size[0], dtype=torch.long)
    sign = torch.where(torch.rand(batch["loss_mask"].shape, generator=g) < 0.5, -1.0, 1.0)
    own = trainer.forward(batch)["logprobs"]
    batch["logprobs"] = torch.where(batch["loss_mask"], own + 0.1 * sign, 0.0)
    algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=recompute)))
    stats = trainer.train(batch, algorithm)
    measured = 1.0 if recompute else 0.5  # the mean over the two optimizer steps
    assert stats["mismatch/measured_fraction"] == pytest.approx(measured)
    assert stats["mismatch/abs_log_ratio_mean"] == pytest.approx(0.1 * measured, rel=1e-3)
    assert stats["mismatch/abs_log_ratio_max"] == pytest.approx(0.1 * measured, rel=1e-3)
