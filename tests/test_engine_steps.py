"""What one optimizer step does with unusual input, in a one-process world: empty mini-batches,
mixed normalizer units, non-finite losses."""

from __future__ import annotations

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


def engine(model_dir, **config) -> TrainEngine:
    torch.manual_seed(0)
    return TrainEngine(model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2), **config))


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


def test_skipping_nonfinite_steps_is_an_explicit_choice_and_is_counted(world, tiny_model_dir):
    e = engine(tiny_model_dir, skip_nonfinite=True)
    before = params(e)
    with pytest.warns(RuntimeWarning, match="step skipped"):
        stats = e.train(fixed_batch(e.model.config.vocab_size), NaNLoss())
    assert stats["skipped_step"] == 1.0 and e.steps == 0
    after = params(e)
    assert all(torch.equal(before[k], after[k]) for k in before)
