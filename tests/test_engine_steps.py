"""What one optimizer step does with unusual input, in a one-process world: empty mini-batches,
mixed normalizer units, non-finite losses."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from areal_flow.config import OptimizerConfig
from areal_flow.runtime import compiled_layers
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


@pytest.mark.parametrize(("aggregation", "entropy_target"),
                         [("token", None), ("sequence", None), ("token", 1e-6)])
def test_skipping_zero_advantage_rows_gives_the_same_step(world, tiny_model_dir, aggregation,
                                                          entropy_target):
    """Two steps: some groups flat, then all flat (AdamW still moves on momentum and the skipped
    rows' zero gradient). Skipping their forward and backward changes nothing but the time: the
    gradients agree to rounding (1e-6 relative), and so do the parameters after AdamW (lr 1e-3:
    AdamW divides by |g|, so rounding in tiny gradients moves a parameter by up to ~lr·1e-4).
    With an entropy target the batch is above, rank 0 knows the bonus is off and skips; another
    rank (which does not take the advantages) trains every row with the entropy's gradient."""
    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import PolicyLossConfig

    class AnotherRank(GRPO):
        def _adapt_entropy_coef(self, batch):
            applied = super()._adapt_entropy_coef(batch)
            self.needs_entropy_grad, self.skips_zero_advantage_rows = True, False
            return applied

    config = GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False, aggregation=aggregation),
                        entropy_target=entropy_target)
    skipping, computing = GRPO(config), (AnotherRank if entropy_target else GRPO)(config)
    computing.skips_zero_advantage_rows = False
    assert skipping.skips_zero_advantage_rows == (entropy_target is None)
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


@pytest.mark.parametrize("packed_attention", [True, False], ids=["row-attention", "mask"])
@pytest.mark.parametrize("value", [False, True], ids=["policy", "critic"])
def test_rows_packed_into_one_micro_batch_get_what_each_gets_alone(world, tiny_model_dir, value,
                                                                   packed_attention, monkeypatch):
    """A micro-batch's rows reach the model packed end to end: no row may see another's tokens,
    whether each row attends on its own (`packed_attention`) or through the block-diagonal mask.
    Each row alone (one row: nothing packed, no padding) through transformers' own attention is
    the reference, for the outputs and for the gradients of a loss over them."""
    from areal_flow.runtime import packed_attention as module

    torch.manual_seed(0)  # the critic's value head
    e = TrainEngine(tiny_model_dir, TrainConfig(packed_attention=packed_attention), value=value)
    torch.manual_seed(0)
    reference = TrainEngine(tiny_model_dir, TrainConfig(packed_attention=False), value=value)
    rows_attended = []
    real = module.F.scaled_dot_product_attention
    monkeypatch.setattr(module.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: rows_attended.append(q.shape[2]) or real(q, *a, **k))
    batch = fixed_batch(e.model.config.vocab_size)[:5]
    assert len(set(batch["attention_mask"].sum(-1).tolist())) == 5  # rows of different lengths
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(1))

    def run(mb, e=e):
        out = e.outputs(mb, entropy="grad")
        got = out.values if value else torch.stack([out.logprobs, out.entropy])
        (got * weights[mb["row"]]).sum().backward()
        return got.detach()

    batch["row"] = torch.arange(5)
    e.model.zero_grad()
    packed = run(batch)
    packed_grads = {n: p.grad.clone() for n, p in e.model.named_parameters()}
    # with packed attention each layer attended each row on its own, else the pack at once
    lengths = batch["attention_mask"].sum(-1).tolist()
    layers = e.model.config.num_hidden_layers
    assert rows_attended == (lengths * layers if packed_attention else [sum(lengths)] * layers)
    alone = torch.cat([run(batch[i : i + 1], reference) for i in range(5)], dim=-2)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(p.grad, packed_grads[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("value", [False, True], ids=["policy", "critic"])
def test_row_attention_is_as_close_to_float64_as_the_mask(world, tiny_model_dir, value):
    """In fp32 row attention and the block-diagonal mask round differently (their gradients
    differ by about 1e-6 of the largest), so neither is the reference: a float64 model is, and
    row attention comes as close to it as the mask (measured: 6e-6 both for the policy, 1.3e-5
    against 1.7e-5 for the critic, the largest gradient 11 and 38)."""
    batch = fixed_batch(100)[:5]
    weights = torch.randn(batch["input_ids"].shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))

    def grads(packed_attention: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # the critic's value head
        e = TrainEngine(tiny_model_dir, TrainConfig(packed_attention=packed_attention),
                        value=value)
        e.model.to(dtype)
        out = e.outputs(batch, entropy="grad")
        got = out.values if value else torch.stack([out.logprobs, out.entropy])
        (got.double() * weights).sum().backward()
        return {n: p.grad.double() for n, p in e.model.named_parameters()}

    reference = grads(False, torch.float64)
    scale = max(g.abs().max().item() for g in reference.values())
    error = {attention: max((g[k] - reference[k]).abs().max().item() for k in reference) / scale
             for attention, g in (("rows", grads(True, torch.float32)),
                                  ("mask", grads(False, torch.float32)))}
    assert error["rows"] <= 1.5 * error["mask"] + 1e-7, error
    assert error["mask"] <= 1e-5, error  # fp32's rounding, not an error of the mask


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


# -- what a step adds up (mutation testing of runtime/engine.py found these unchecked) ----------


class CountingNLL(TokenNLL):
    """TokenNLL whose stats say how many rows each micro-batch had; `unit`/`constant` choose the
    normalizer; `skips_zero_advantage_rows` makes it an advantage-weighted loss."""

    def __init__(self, unit: str = "tokens", constant: float = 0.0, weighted: bool = False):
        self.unit, self.constant, self.rows = unit, constant, []
        self.skips_zero_advantage_rows = weighted

    def loss(self, out, mb):
        mask = mb.loss_mask.float()
        weight = mb.advantages if self.skips_zero_advantage_rows else 1.0
        rows = mb.loss_mask.shape[0]
        self.rows.append(rows)
        return LossOutput(loss_sum=-(weight * out.logprobs * mask).sum(),
                          normalizer=self.constant if self.unit == "constant" else mask.sum(),
                          unit=self.unit, stats={"rows": torch.tensor(float(rows))})


def summed_nll_gradients(model_dir, batch) -> dict[str, torch.Tensor]:
    """The gradient of the summed NLL of every loss token, computed on the plain model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    nll = torch.zeros(())
    for row in range(batch.batch_size[0]):
        n = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :n][None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
        nll = nll - (picked * batch["loss_mask"][row, 1:n]).sum()
    nll.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_a_steps_statistics_are_micro_batch_means_and_its_counts_are_totals(world,
                                                                             tiny_model_dir):
    e = engine(tiny_model_dir, max_tokens_per_mb=60)  # several micro-batches
    batch, loss = fixed_batch(e.model.config.vocab_size), CountingNLL()
    stats = e.train(batch, loss)
    assert len(loss.rows) >= 3 and sum(loss.rows) == batch.batch_size[0]
    assert stats["rows"] == pytest.approx(sum(loss.rows) / len(loss.rows))
    assert stats["train/micro_batches"] == len(loss.rows)
    tokens = int(batch["attention_mask"].sum())
    assert stats["train/tokens"] == tokens
    assert stats["train/mb_fill"] == pytest.approx(tokens / len(loss.rows) / 60)


@pytest.mark.parametrize("unit", ["tokens", "constant"])
def test_the_gradient_is_the_summed_loss_over_its_normalizer_however_the_batch_is_split(
        world, tiny_model_dir, unit):
    """A summed unit's normalizer adds up over micro-batches; a constant one is used as it is
    (not once per micro-batch). Against the gradient of the plain model's summed NLL."""
    e = TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-9, max_grad_norm=1e9),
                                                max_tokens_per_mb=60))
    batch = fixed_batch(e.model.config.vocab_size)
    stats = e.train(batch, CountingNLL(unit, constant=7.0))
    normalizer = 7.0 if unit == "constant" else float(batch["loss_mask"][:, 1:].sum())
    assert stats["normalizer"] == normalizer
    expected = summed_nll_gradients(tiny_model_dir, batch)
    got = e.full_grads()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad / normalizer, rtol=1e-4, atol=1e-6)


def test_a_step_of_one_loss_token_trains_on_it_and_reports_its_loss(world, tiny_model_dir):
    e = engine(tiny_model_dir)
    batch = fixed_batch(e.model.config.vocab_size)[:1]
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    batch["loss_mask"][0, 5] = True
    logp = e.forward(batch)["logprobs"][0, 5].item()
    before = params(e)
    stats = e.train(batch, TokenNLL())
    assert stats["normalizer"] == 1.0 and stats["loss"] == pytest.approx(-logp, rel=1e-5)
    after = params(e)
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4


def test_a_step_without_loss_tokens_is_a_zero_step_not_an_error(world, tiny_model_dir):
    e = engine(tiny_model_dir)
    batch = fixed_batch(e.model.config.vocab_size)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    stats = e.train(batch, TokenNLL())
    assert (stats["loss"], stats["grad_norm"], stats["normalizer"]) == (0.0, 0.0, 0.0)


def test_one_moving_and_one_skipped_row_take_a_step(world, tiny_model_dir):
    """One micro-batch and one row skipped for its zero advantages: a step all the same."""
    e = engine(tiny_model_dir)
    batch = fixed_batch(e.model.config.vocab_size)[:2]
    batch["advantages"] = torch.stack([torch.zeros(40), torch.ones(40)])
    stats = e.train(batch, CountingNLL(weighted=True))
    assert (e.steps, stats["skipped_step"], stats["train/skipped_rows"]) == (1, 0.0, 1.0)
    # one micro-batch: its statistics are the step's, its tokens fill its budget so far
    assert (stats["train/micro_batches"], stats["rows"]) == (1.0, 1.0)
    tokens = int(batch["attention_mask"][1].sum())
    assert stats["train/mb_fill"] == pytest.approx(tokens / e.config.max_tokens_per_mb)


def test_a_batch_without_rows_takes_no_step_and_says_so(world, tiny_model_dir):
    e = engine(tiny_model_dir)
    stats = e.train(fixed_batch(e.model.config.vocab_size)[:0], TokenNLL())
    assert e.steps == 0 and stats == {"skipped_step": 1.0, "lr": pytest.approx(1e-2)}


class NaNLossFiniteGradient(TokenNLL):
    def loss(self, out, mb):
        result = super().loss(out, mb)
        return LossOutput(loss_sum=result.loss_sum + torch.tensor(float("nan")),
                          normalizer=result.normalizer, unit="tokens")


def test_a_nonfinite_loss_stops_the_step_even_when_its_gradient_is_finite(world, tiny_model_dir):
    e = engine(tiny_model_dir)
    with pytest.raises(FloatingPointError, match="optimizer step 1: loss nan"):
        e.train(fixed_batch(e.model.config.vocab_size), NaNLossFiniteGradient())
    assert e.steps == 0


def test_an_entropy_bonus_raises_the_policys_entropy_through_the_engine(world, tiny_model_dir):
    """GRPO with entropy_coef > 0 on flat groups (every advantage 0): only the entropy term
    moves the policy, and it must move it towards more entropy (the engine has to give the loss
    an entropy that carries a gradient)."""
    from areal_flow.algorithms.grpo import GRPO, GRPOConfig

    e = engine(tiny_model_dir, lr=3e-3)
    batch = grpo_batch(e.model.config.vocab_size, flat_groups=list(range(6)))
    algorithm = GRPO(GRPOConfig(entropy_coef=1.0))
    assert algorithm.needs_entropy_grad and not algorithm.skips_zero_advantage_rows

    def entropy() -> float:
        with torch.no_grad():
            out = e.outputs(batch)  # the default: the entropy as a metric
        mask = batch["loss_mask"]
        return float((out.entropy * mask).sum() / mask.sum())

    before = entropy()
    with torch.no_grad():  # with the entropy's gradient asked for, the log-probs are the same
        torch.testing.assert_close(e.outputs(batch, entropy="grad").logprobs,
                                   e.outputs(batch, entropy="none").logprobs)
    for _ in range(3):
        stats = e.train(batch, algorithm)
    assert "entropy" in stats
    assert entropy() > before + 0.01


def test_step_totals_add_up_exactly_past_float32s_integers(world, tiny_model_dir):
    from areal_flow.runtime.engine import StepTotals

    engine(tiny_model_dir)  # the one-process world
    big = 2**24 + 1  # float32 has no such integer: a large run's token count
    totals = StepTotals(loss_sum=1.0 + 2**-30, normalizer=float(big), micro_batches=3,
                        skipped_rows=0, tokens=big).summed_over_ranks()
    assert (totals.tokens, totals.normalizer, totals.loss_sum) == (big, big, 1.0 + 2**-30)


def test_a_reference_is_a_frozen_copy_of_the_initial_weights(world, tiny_model_dir):
    """Without LoRA the reference is a second model, frozen: no optimizer state, no gradients,
    and the policy's steps leave its log-probs where the initial weights had them."""
    e = engine(tiny_model_dir)
    ref = e.reference(tiny_model_dir)
    assert ref is not e and ref.optimizer is None
    assert not any(p.requires_grad for p in ref.model.parameters())
    assert ref.memory_gb()["optimizer"] == 0.0 and ref.memory_gb()["gradients"] == 0.0
    batch = fixed_batch(e.model.config.vocab_size)
    initial = e.forward(batch)["logprobs"]
    for _ in range(2):
        e.train(batch, TokenNLL())
    assert (e.forward(batch)["logprobs"] - initial).abs().max() > 1e-3
    torch.testing.assert_close(ref.forward(batch)["logprobs"], initial)


def test_full_state_dict_is_a_copy_the_caller_may_change(world, tiny_model_dir):
    e = engine(tiny_model_dir)
    state = e.full_state_dict()
    for t in state.values():
        t.zero_()
    assert max(p.abs().max().item() for p in e.model.parameters()) > 0.01


class FolderPool:
    """Records what `sync_weights(folder=...)` hands a pool."""

    in_process = False

    def __init__(self):
        self.updates = []

    def update_weights(self, update):
        self.updates.append(update)


def test_a_bf16_engines_folder_sync_writes_its_full_weights(world, tiny_model_dir, tmp_path):
    """bf16 in one process: FSDP2 holds the parameters as DTensors; the folder the servers load
    holds them whole, equal to `full_state_dict`, and the sync's timings add up."""
    import time

    from safetensors.torch import load_file

    e = engine(tiny_model_dir, dtype="bfloat16")
    assert e.sharded
    e.train(fixed_batch(e.model.config.vocab_size), TokenNLL())
    pool, began = FolderPool(), time.perf_counter()
    sync = e.sync_weights(pool, 1, folder=tmp_path / "weights")
    took = time.perf_counter() - began
    assert 0 <= sync["sync/gather_seconds"] and 0 <= sync["sync/send_seconds"]
    assert sync["sync/gather_seconds"] + sync["sync/send_seconds"] <= took
    [update] = pool.updates
    written = load_file(f"{update.path}/model.safetensors")
    expected = e.full_state_dict()
    assert all(type(t) is torch.Tensor for t in expected.values())
    for name, tensor in written.items():
        torch.testing.assert_close(tensor, expected[name])
    assert sync["sync/bytes"] == sum(t.numel() * t.element_size() for t in {
        t.data_ptr(): t for t in expected.values()}.values())


def test_an_engine_that_copies_the_weights_is_not_paused_by_the_next_step(world, tiny_model_dir):
    """Only an engine that reads the trainer's own tensors (`live`) is held during an optimizer
    step; one that copied them (bf16 here, the trainer fp32) keeps generating."""
    from areal_flow.inference.local import LocalEngine

    fp32, bf16 = engine(tiny_model_dir), engine(tiny_model_dir, dtype="bfloat16")
    batch = fixed_batch(fp32.model.config.vocab_size)
    # a bf16 trainer's weights are FSDP2's shards, gathered into copies
    for e, dtype, held in ((fp32, "bfloat16", False), (bf16, "bfloat16", False),
                           (fp32, "float32", True)):
        pool = LocalEngine(tiny_model_dir, dtype=dtype)
        try:
            sync = e.sync_weights(pool, 1)
            assert (sync["sync/bytes"] == 0) == held
            paused: list[bool] = []
            pool.pause = lambda *a, **k: paused.append(True)  # noqa: B023 - read at once
            e.train(batch, TokenNLL())
            assert bool(paused) == held
        finally:
            e._readers = None
            pool.close()


def test_each_minibatch_sees_how_far_the_weights_have_moved(world, tiny_model_dir):
    """With three optimizer steps per batch, the k-th mini-batch's rows carry progress k / 3
    (the version-based proximal approximation reads it)."""
    seen = []

    class Recording(TokenNLL):
        def loss(self, out, mb):
            seen.append(sorted(set(mb.minibatch_progress.tolist())))
            return super().loss(out, mb)

    e = engine(tiny_model_dir, ppo_minibatches=3)
    e.train(fixed_batch(e.model.config.vocab_size), Recording())
    assert sorted({p for values in seen for p in values}) == pytest.approx([0, 1 / 3, 2 / 3])
    assert all(len(values) == 1 for values in seen)


def test_a_micro_batch_is_one_forward_and_grpo_reports_the_entropy(world, tiny_model_dir):
    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import PolicyLossConfig

    e = engine(tiny_model_dir, max_tokens_per_mb=60)
    forwards = []
    e.model.register_forward_hook(lambda *_: forwards.append(1))
    algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False)))  # no roles
    stats = e.train(grpo_batch(e.model.config.vocab_size, flat_groups=[]), algorithm)
    assert len(forwards) == stats["train/micro_batches"] >= 3
    assert 0.1 < stats["entropy"] < math.log(e.model.config.vocab_size) + 1e-3


def test_the_episodes_info_and_metrics_stay_on_the_callers_batch(world, tiny_model_dir):
    """The scheduler's batch carries the episodes' info (not tensors) and task metrics for
    samples.jsonl and metrics.jsonl: training leaves them out and the caller keeps them."""
    from tensordict import NonTensorStack, TensorDict

    e = engine(tiny_model_dir)
    batch = fixed_batch(e.model.config.vocab_size)
    rows = batch.batch_size[0]
    batch["metrics"] = TensorDict({"accuracy": torch.ones(rows)}, batch_size=[rows])
    batch["info"] = NonTensorStack(*({"row": i} for i in range(rows)))
    stats = e.train(batch, TokenNLL())
    assert e.steps == 1 and math.isfinite(stats["loss"])
    assert {"metrics", "info"} <= set(batch.keys())


def test_master_weights_are_fp32_whatever_dtype_the_checkpoint_holds(world, tiny_model_dir,
                                                                      tmp_path):
    """SmolLM2's checkpoint is bf16: the trainer's own weights (and the critic's) are fp32
    all the same (bf16 compute is FSDP2's cast, `dtype`), not the checkpoint's dtype."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "bf16")
    for value in (False, True):
        e = TrainEngine(tmp_path / "bf16", TrainConfig(), value=value)
        assert {p.dtype for p in e.model.parameters()} == {torch.float32}


@pytest.mark.parametrize("value", [False, True], ids=["policy", "critic"])
def test_activation_checkpointing_recomputes_the_layers_and_keeps_the_gradients(
        world, tiny_model_dir, value):
    class ValueMSE(TokenNLL):
        def loss(self, out, mb):
            mask = mb.loss_mask.float()
            return LossOutput(loss_sum=((out.values - 1) ** 2 * mask).sum(),
                              normalizer=mask.sum(), unit="tokens")

    grads, calls = {}, {}
    for on in (False, True):
        torch.manual_seed(0)
        e = TrainEngine(tiny_model_dir, TrainConfig(activation_checkpointing=on), value=value)
        mlp = (e.model.backbone if value else e.model.model).layers[0].mlp
        calls[on] = []
        mlp.register_forward_pre_hook(lambda *_: calls[on].append(1))  # noqa: B023
        batch = fixed_batch(e.model.config.vocab_size)[:2]
        e.train(batch, ValueMSE() if value else TokenNLL())
        grads[on] = e.full_grads()
    assert len(calls[True]) == 2 * len(calls[False])  # forward, and again in backward
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-7)


def test_a_bf16_engine_computes_every_module_in_bf16(world, tiny_model_dir):
    """The layers and the root's own modules (embeddings, final norm) run on bf16 weights."""
    e = engine(tiny_model_dir, dtype="bfloat16")
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen.setdefault(name, (module.weight.dtype, out.dtype))
        return hook

    for name, module in (("embed", e.model.model.embed_tokens),
                         ("mlp", e.model.model.layers[0].mlp.down_proj)):
        module.register_forward_hook(record(name))
    e.train(fixed_batch(e.model.config.vocab_size), TokenNLL())
    assert seen == {"embed": (torch.bfloat16, torch.bfloat16),
                    "mlp": (torch.bfloat16, torch.bfloat16)}


def test_mfu_is_six_flops_per_parameter_and_token_over_the_measured_rate(world, tiny_model_dir,
                                                                         monkeypatch):
    """MFU as the field defines it (6 N FLOPs per trained token: forward and backward) over the
    GEMM rate measured for this model in the dtype in use, measured once."""
    from transformers import AutoModelForCausalLM

    from areal_flow.runtime import engine as engine_module

    asked = []

    def rate(model, dtype, device="cpu"):
        asked.append((str(model), dtype))
        return 1e12

    monkeypatch.setattr(engine_module, "gemm_rate", rate)
    e = engine(tiny_model_dir)
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert e.mfu(tokens=1000, seconds=2.0) == pytest.approx(6 * n * 1000 / 2.0 / 1e12)
    assert e.mfu(tokens=500, seconds=2.0) == pytest.approx(6 * n * 500 / 2.0 / 1e12)
    assert asked == [(str(tiny_model_dir), "float32")]


def test_the_optimizer_settings_reach_adamw(world, tiny_model_dir):
    custom = TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(
        lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1)))
    group = custom.optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (3e-3, (0.8, 0.95), 0.1)


def test_auto_precision_measures_this_models_shapes(world, tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    e = engine(tiny_model_dir, dtype="auto")
    assert set(e.precision.seconds) == {"float32", "bfloat16"}
    assert e.precision.shape[1:3] == (config.hidden_size, config.intermediate_size)


def test_the_stations_one_by_one_take_trains_step(world, tiny_model_dir):
    """role_forwards → advantages → update is `train`; an algorithm without roles keeps rank
    0's batch whole until its advantages (no round trip), one with roles runs them first."""
    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import PolicyLossConfig

    for recompute in (False, True):
        algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=recompute)))
        by_stations, whole = engine(tiny_model_dir), engine(tiny_model_dir)
        batch = grpo_batch(by_stations.model.config.vocab_size, flat_groups=[1])
        shard = by_stations.role_forwards(batch, algorithm)
        if recompute:
            assert shard.owned is not None and "prox_logprobs" in shard.rows.keys()
        else:
            assert shard.owned is None and shard.rows.batch_size == batch.batch_size
            assert "advantages" not in shard.rows.keys()
        with pytest.raises(ValueError, match="takes what advantages"):
            by_stations.update(shard, algorithm) if shard.owned is None else \
                by_stations.update(attrs.evolve(shard, owned=None), algorithm)
        shard = by_stations.advantages(shard, algorithm)
        assert shard.owned is not None and "advantages" in shard.rows.keys()
        stats = by_stations.update(shard, algorithm)
        assert stats == pytest.approx(whole.train(batch, algorithm))
        a, b = params(by_stations), params(whole)
        assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@pytest.mark.skipif(compiled_layers.cpu_compiler() is None, reason="torch.compile needs a C++ "
                    "compiler on a CPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layers_take_the_eager_step(world, tiny_model_dir, dtype):
    """`TrainConfig.compile`: each decoder layer's MLP and norms compiled (inductor fuses their
    element-wise chains) give the eager fp32 model's losses and gradients, at the start and after
    an optimizer step, on packed rows attended one by one. fp32: within its rounding. bf16: as
    close as the eager bf16 model comes (inductor rounds once per fused chain, eager once per
    operation; measured: 0.7 % and 5 % of the gradient's norm at the two steps, either way).
    The weights are not compared: AdamW's first steps move each weight by about lr whatever its
    gradient's size, so rounding in a near-zero gradient moves a weight visibly."""
    from torch._dynamo.utils import counters

    def distance(grads, reference):
        return math.sqrt(sum((grads[k] - reference[k]).square().sum() for k in reference)
                         / sum(g.square().sum() for g in reference.values()))

    compiled = engine(tiny_model_dir, compile="on", dtype=dtype, packed_attention=True)
    eager = engine(tiny_model_dir, compile="off", dtype=dtype, packed_attention=True)
    fp32 = eager if dtype == "float32" else engine(tiny_model_dir, packed_attention=True)
    assert (compiled.compiled, eager.compiled) == (True, False)
    graphs = counters["stats"]["unique_graphs"]
    batch = fixed_batch(eager.model.config.vocab_size)
    for _ in range(2):
        losses = [e.train(batch, TokenNLL())["loss"] for e in {compiled, eager, fp32}]
        reference = fp32.full_grads()
        got = distance(compiled.full_grads(), reference)
        if dtype == "float32":
            assert got <= 1e-5 and max(losses) - min(losses) <= 1e-5 * max(losses), got
        else:
            assert got <= 1.25 * distance(eager.full_grads(), reference) + 1e-3, got
    assert counters["stats"]["unique_graphs"] > graphs  # the compiled parts ran


@pytest.mark.skipif(compiled_layers.cpu_compiler() is None, reason="torch.compile needs a C++ "
                    "compiler on a CPU")
def test_a_compiled_mlp_keeps_gate_and_up_for_backward_and_recomputes_their_product(
        tiny_model_dir):
    """`compiled_layers.ACTIVATION_BUDGET`: of the MLP's intermediate-width tensors, backward
    keeps the gate and up projections' outputs (their GEMMs are not redone) and recomputes
    silu(gate) * up, which the partitioner would otherwise keep as well."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    compiled_layers.compile_pointwise_parts(model.model)
    mlp, width = model.model.layers[0].mlp, model.config.intermediate_size
    for rows in (24, 40):  # the second shape runs the dynamic graph
        x = torch.randn(rows, model.config.hidden_size, requires_grad=True)
        kept = []

        def keep(t):
            if t.dim() == 2 and t.shape == (rows, width):
                kept.append(t.detach().clone())
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            mlp(x).sum().backward()
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    assert len(kept) == 2, [t.shape for t in kept]
    assert {min(range(2), key=lambda i: (t - (gate, up)[i]).abs().max()) for t in kept} == {0, 1}
    assert all(min((t - r).abs().max() for r in (gate, up)) < 1e-5 for t in kept)


def test_every_norm_and_mlp_is_compiled_and_no_attention(tiny_model_dir):
    """`compile_pointwise_parts` picks a layer's children by class: a name test once skipped
    every `post_attention_layernorm` (half the norms ran eager: 0.6 s of a 5.5 s SmolLM2 step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    compiled_layers.compile_pointwise_parts(model.model)

    def compiled(module):
        return getattr(module, "_compiled_call_impl", None) is not None

    layers = model.model.layers
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * len(layers) + 1 and all(compiled(n) for n in norms)
    assert all(compiled(layer.mlp) and not compiled(layer.self_attn) for layer in layers)


def test_compile_on_without_a_cpu_compiler_names_the_field(monkeypatch):
    """Refused when the recipe's config is built (before any model is read), naming the
    option; "auto" then runs eager."""
    from areal_flow.rl_recipes import RLConfig

    monkeypatch.setattr(compiled_layers, "cpu_compiler", lambda: None)
    with pytest.raises(ValueError, match="--critic.compile 'on' needs a C\\+\\+ compiler"):
        RLConfig(critic=TrainConfig(compile="on"))
    assert not compiled_layers.wanted("auto", torch.device("cpu"))


def test_an_update_gives_the_freed_heap_back_to_the_os(world, tiny_model_dir):
    """What a thread other than the main one frees under glibc's mmap threshold stays resident
    in that thread's heap (here 0.5 MiB blocks, each pinned in place by a small one after it),
    as the engine thread's and the trainer's did in the default GSM8K run (its resident memory
    grew 1.1 GB over 24 steps); `update` returns those pages (glibc's `malloc_trim`)."""
    import threading

    from areal_flow.process_memory import rss_bytes

    e = engine(tiny_model_dir)
    batch = fixed_batch(e.model.config.vocab_size)
    e.train(batch, TokenNLL())
    kept: list[torch.Tensor] = []

    def allocate_and_free():
        pairs = [(torch.ones(2**17), torch.ones(8)) for _ in range(800)]  # 400 MiB
        kept.extend(small for _, small in pairs)

    start = rss_bytes()
    worker = threading.Thread(target=allocate_and_free)
    worker.start()
    worker.join()
    assert rss_bytes() - start > 300 * 2**20, (rss_bytes() - start) / 2**20  # still resident
    e.train(batch, TokenNLL())
    assert rss_bytes() - start < 100 * 2**20, (rss_bytes() - start) / 2**20


@pytest.mark.parametrize("target", [100.0, 1e-6])
def test_an_entropy_target_reaches_the_loss_through_the_engine(world, tiny_model_dir, target):
    """GRPO with `entropy_target` on flat groups (every advantage 0): a target above the batch's
    entropy applies the bonus and raises the policy's entropy; one below it applies none, and
    the weights do not move, and flat rows skip their forward and backward (the coefficient
    travels as a batch column to the loss)."""
    from areal_flow.algorithms.grpo import GRPO, GRPOConfig

    e = engine(tiny_model_dir, lr=3e-3)
    batch = grpo_batch(e.model.config.vocab_size, flat_groups=list(range(6)))
    algorithm = GRPO(GRPOConfig(entropy_target=target, entropy_coef_step=0.5))

    def entropy() -> float:
        with torch.no_grad():
            out = e.outputs(batch)
        return float((out.entropy * batch["loss_mask"]).sum() / batch["loss_mask"].sum())

    before = entropy()
    steps = [e.train(batch, algorithm) for _ in range(3)]
    if target > 1:
        assert [s["entropy_coef"] for s in steps] == pytest.approx([0.5, 1.0, 1.5])
        assert [s["train/skipped_rows"] for s in steps] == [0, 0, 0]
        assert entropy() > before + 0.01
    else:  # no bonus: the flat rows are skipped, as without entropy control
        assert [s["train/skipped_rows"] for s in steps] == [batch.batch_size[0]] * 3
        assert entropy() == pytest.approx(before, abs=1e-6)
