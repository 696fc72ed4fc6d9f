"""What one optimizer step does with unusual input, in a one-process world: empty mini-batches,
mixed normalizer units, non-finite losses."""

from __future__ import annotations

import math

import pytest
import torch

from areal_flow.config import OptimizerConfig
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.types import LossOutput
from tests.dist_train_script import TokenNLL, fixed_batch


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def engine(model_dir, lr: float = 1e-2, **config) -> TrainEngine:
    torch.manual_seed(0)
    return TrainEngine(model_dir, TrainConfig(optim=OptimizerConfig(lr=lr), **config))


def params(e: TrainEngine) -> dict[str, torch.Tensor]:
    return e.full_state_dict()


def test_a_minibatch_without_rows_takes_no_optimizer_step(world, tiny_model_dir):
    """Two groups, three mini-batches: the third is empty on every rank. AdamW must not step on
    momentum alone, and the LR schedule must not advance."""
    two = engine(tiny_model_dir, ppo_minibatches=2)
    three = engine(tiny_model_dir, ppo_minibatches=3)
    batch = fixed_batch(two.model.config.vocab_size)[:4]  # groups 0 and 1
    for _ in range(2):
        two.train(batch, TokenNLL())
        stats = three.train(batch, TokenNLL())
    assert (two.steps, three.steps) == (4, 4)
    assert stats["skipped_step"] == pytest.approx(1 / 3)
    end_two, end_three = params(two), params(three)
    assert max((end_two[k] - end_three[k]).abs().max().item() for k in end_two) < 1e-6


class MixedUnits(TokenNLL):
    """A buggy loss: its unit depends on the micro-batch."""

    def __init__(self):
        self.calls = 0

    def loss(self, out, mb):
        self.calls += 1
        result = super().loss(out, mb)
        unit = "tokens" if self.calls % 2 else "constant"
        return LossOutput(loss_sum=result.loss_sum, normalizer=result.normalizer, unit=unit)


def test_normalizer_units_that_differ_between_micro_batches_are_an_error(world, tiny_model_dir):
    e = engine(tiny_model_dir, max_tokens_per_mb=60)  # several micro-batches
    with pytest.raises(ValueError, match="summed .* and constant"):
        e.train(fixed_batch(e.model.config.vocab_size), MixedUnits())
    assert e.steps == 0


class NaNLoss(TokenNLL):
    def loss(self, out, mb):
        result = super().loss(out, mb)
        return LossOutput(loss_sum=result.loss_sum * float("nan"), normalizer=result.normalizer,
                          unit="tokens")


def test_a_nonfinite_step_stops_the_run_naming_the_step(world, tiny_model_dir):
    e = engine(tiny_model_dir)
    batch = fixed_batch(e.model.config.vocab_size)
    e.train(batch, TokenNLL())
    with pytest.raises(FloatingPointError, match="optimizer step 2: loss nan"):
        e.train(batch, NaNLoss())


def grpo_batch(vocab: int, flat_groups: list[int]):
    """The fixed batch with GRPO's keys: the rewards of `flat_groups` are equal (A = 0)."""
    batch = fixed_batch(vocab)
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(batch.batch_size[0], generator=g)
    for group in flat_groups:
        rewards[batch["group_ids"] == group] = 0.5
    batch["rewards"] = rewards
    batch["logprobs"] = -torch.rand(batch["logprobs"].shape, generator=g) * batch["loss_mask"]
    batch["policy_version"] = torch.zeros(batch.batch_size[0], dtype=torch.long)
    return batch


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_skipping_zero_advantage_rows_gives_the_same_step(world, tiny_model_dir, aggregation):
    """Two steps: some groups flat, then all flat (AdamW still moves on momentum and the skipped
    rows' zero gradient). Skipping their forward and backward changes nothing but the time: the
    gradients agree to rounding (1e-6 relative), and so do the parameters after AdamW (lr 1e-3:
    AdamW divides by |g|, so rounding in tiny gradients moves a parameter by up to ~lr·1e-4)."""
    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import PolicyLossConfig

    config = GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False, aggregation=aggregation))
    skipping, computing = GRPO(config), GRPO(config)
    computing.skips_zero_advantage_rows = False
    assert skipping.skips_zero_advantage_rows
    a, b = engine(tiny_model_dir, 1e-3, max_tokens_per_mb=120), engine(tiny_model_dir, 1e-3)
    vocab = a.model.config.vocab_size
    for flat, skipped in (([0, 2, 3], 6), (list(range(6)), 12)):
        batch = grpo_batch(vocab, flat)
        stats_a, stats_b = a.train(batch, skipping), b.train(batch, computing)
        assert (stats_a["train/skipped_rows"], stats_b["train/skipped_rows"]) == (skipped, 0)
        assert stats_a["normalizer"] == stats_b["normalizer"]
        assert stats_a["loss"] == pytest.approx(stats_b["loss"], abs=1e-7)
        grads_a, grads_b = a.full_grads(), b.full_grads()
        scale = max(g.abs().max().item() for g in grads_b.values())
        assert (scale > 0) == (skipped < 12)  # an all-flat batch has no gradient at all
        assert max((grads_a[k] - grads_b[k]).abs().max().item() for k in grads_b) <= 1e-6 * scale
        end_a, end_b = params(a), params(b)
        assert max((end_a[k] - end_b[k]).abs().max().item() for k in end_a) < 1e-6
    start = params(engine(tiny_model_dir))
    assert max((end_a[k] - start[k]).abs().max().item() for k in end_a) > 1e-4  # it did learn


def test_fused_adamw_takes_the_step_of_the_reference_implementation(world, tiny_model_dir):
    """The runtime's fused AdamW (chosen for memory) against torch's per-parameter loop."""
    fused, reference = engine(tiny_model_dir, 1e-3), engine(tiny_model_dir, 1e-3)
    assert fused.optimizer.defaults["fused"]
    o = reference.config.optim
    reference.optimizer = torch.optim.AdamW(reference.model.parameters(), lr=o.lr, betas=o.betas,
                                            weight_decay=o.weight_decay, foreach=False)
    reference.scheduler = torch.optim.lr_scheduler.LambdaLR(reference.optimizer, lambda _: 1.0)
    batch = fixed_batch(fused.model.config.vocab_size)
    for _ in range(3):
        fused.train(batch, TokenNLL())
        reference.train(batch, TokenNLL())
    start, a, b = params(engine(tiny_model_dir)), params(fused), params(reference)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-3  # it moved


@pytest.mark.parametrize("value", [False, True], ids=["policy", "critic"])
def test_rows_packed_into_one_micro_batch_get_what_each_gets_alone(world, tiny_model_dir, value):
    """A micro-batch's rows reach the model packed end to end: no row may see another's tokens.
    Each row alone (one row: nothing packed, no padding) is the reference, for the outputs and
    for the gradients of a loss over them."""
    e = TrainEngine(tiny_model_dir, TrainConfig(), value=value)
    batch = fixed_batch(e.model.config.vocab_size)[:5]
    assert len(set(batch["attention_mask"].sum(-1).tolist())) == 5  # rows of different lengths
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(1))

    def run(mb):
        out = e.outputs(mb, entropy="grad")
        got = out.values if value else torch.stack([out.logprobs, out.entropy])
        (got * weights[mb["row"]]).sum().backward()
        return got.detach()

    batch["row"] = torch.arange(5)
    e.model.zero_grad()
    packed = run(batch)
    packed_grads = {n: p.grad.clone() for n, p in e.model.named_parameters()}
    e.model.zero_grad()
    alone = torch.cat([run(batch[i : i + 1]) for i in range(5)], dim=-2)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    for name, p in e.model.named_parameters():
        torch.testing.assert_close(p.grad, packed_grads[name], atol=1e-5, rtol=1e-5, msg=name)


ROLE_MODELS = {
    "ref": lambda actor, path, config: actor.reference(path),
    "critic": lambda actor, path, config: TrainEngine(path, config, value=True),
    "teacher": lambda actor, path, config: TrainEngine(path, config, trainable=False),
}
"""How each role beside the actor is built (its untrained weights: π_ref = π_teacher = π)."""


def _registered_algorithms() -> list[str]:
    from areal_flow.registry import algorithms

    return algorithms.names()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", _registered_algorithms())
def test_every_algorithm_trains_a_step_whose_advantages_are_all_zero(world, tiny_model_dir,
                                                                      name, bf16):
    """The first step of a run whose rewards are all equal: every role is the untrained policy
    and the critic's head is 0, so every advantage is 0 (rows an algorithm skips get no forward
    or backward at all). The step must still be taken, in fp32 and under the bf16 default; the
    batch carries every key a registered algorithm reads (DPO's pairs: adjacent rows)."""
    from areal_flow.registry import algorithms

    spec = algorithms.spec(name)
    algorithm = spec.cls(spec.config() if spec.config else None)
    config = TrainConfig(dtype="bfloat16" if bf16 else "float32")
    torch.manual_seed(0)
    actor = TrainEngine(tiny_model_dir, config)
    roles = {role: ROLE_MODELS[role](actor, tiny_model_dir, config)
             for role in algorithm.roles if role != "actor"}
    if hasattr(algorithm, "critic_loss"):
        roles.setdefault("critic", ROLE_MODELS["critic"](actor, tiny_model_dir, config))
    batch = fixed_batch(actor.model.config.vocab_size)
    rows = batch.batch_size[0]
    batch["logprobs"] = actor.forward(batch)["logprobs"]  # on-policy: sampled by these weights
    batch["chosen"] = torch.arange(rows) % 2 == 0
    batch["truncated"] = torch.zeros(rows, dtype=torch.bool)
    batch["policy_version"] = torch.zeros(rows, dtype=torch.long)
    seen = []
    compute = algorithm.advantages
    algorithm.advantages = lambda b: seen.append(compute(b)) or seen[-1]
    stats = actor.train(batch, algorithm, **roles)
    if "advantages" in seen[0].keys():  # the case this test is about (SFT and DPO have none)
        assert seen[0]["advantages"].abs().max().item() == 0.0
    assert (actor.steps, stats["skipped_step"]) == (1, 0.0)
    assert all(map(math.isfinite, (stats["loss"], stats["grad_norm"])))


def test_keeping_the_gathered_bf16_weights_through_a_step_gives_the_same_step(world,
                                                                              tiny_model_dir):
    """bf16 in one process, several micro-batches a step: FSDP2 keeps its gathered weights from
    the first forward to the last backward and reduces the gradients once (`keep_unsharded`),
    instead of gathering, casting and reducing per micro-batch. The gradients agree with the
    per-micro-batch reduction to fp32 summation order (1e-5 relative), and two steps later the
    weights agree; the weights are sharded again after each step (the sync reads them)."""
    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import PolicyLossConfig

    algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False)))
    kept, freed = (engine(tiny_model_dir, 1e-3, dtype="bfloat16", max_tokens_per_mb=60,
                          keep_unsharded=keep) for keep in (True, False))
    assert kept.sharded and freed.sharded
    vocab = kept.model.config.vocab_size
    for flat in ([0, 2], [1]):
        batch = grpo_batch(vocab, flat)
        stats_a, stats_b = kept.train(batch, algorithm), freed.train(batch, algorithm)
        assert stats_a["train/micro_batches"] == stats_b["train/micro_batches"] >= 3
        assert stats_a["loss"] == pytest.approx(stats_b["loss"], rel=1e-5)
        grads_a, grads_b = kept.full_grads(), freed.full_grads()
        scale = max(g.abs().max().item() for g in grads_b.values())
        assert scale > 0
        assert max((grads_a[k] - grads_b[k]).abs().max().item() for k in grads_b) <= 1e-5 * scale
        assert all(type(p).__name__ == "DTensor" for p in kept.model.parameters())  # resharded
    end_a, end_b = params(kept), params(freed)
    assert max((end_a[k] - end_b[k]).abs().max().item() for k in end_a) < 1e-5
