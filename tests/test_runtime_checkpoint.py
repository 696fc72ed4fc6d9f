"""Checkpoints and weight sync of the runtime, in a one-process world."""

from __future__ import annotations

import asyncio

import attrs
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_flow.config import OptimizerConfig
from areal_flow.inference.local import LocalEngine
from areal_flow.runtime import checkpoint
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.types import GenerationRequest, SamplingParams, WeightUpdate
from tests.dist_train_script import TokenNLL, fixed_batch
from tests.test_local_engine import generate_together


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def engine(model_dir):
    return TrainEngine(model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2),
                                              max_tokens_per_mb=200))


def test_hf_checkpoint_round_trip_gives_identical_logits(world, tiny_model_dir, tmp_path):
    trainer = engine(tiny_model_dir)
    batch = fixed_batch(trainer.model.config.vocab_size)
    trainer.train(batch, TokenNLL())
    checkpoint.save_hf(trainer, tmp_path / "hf", tokenizer_from=tiny_model_dir)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = batch["input_ids"][:2, :20]
    with torch.no_grad():
        expected = trainer.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert torch.equal(loaded(ids).logits, expected)
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_resume_gives_the_same_next_step_loss(world, tiny_model_dir, tmp_path):
    algorithm = TokenNLL()
    straight = engine(tiny_model_dir)
    batch = fixed_batch(straight.model.config.vocab_size)
    straight.train(batch, algorithm)
    checkpoint.save_checkpoint(straight, tmp_path / "ckpt",
                               extra_state={"scheduler": {"position": 7}})
    expected = [straight.train(batch, algorithm)["loss"] for _ in range(2)]

    resumed = engine(tiny_model_dir)
    extra = checkpoint.load_checkpoint(resumed, tmp_path / "ckpt")
    assert extra == {"scheduler": {"position": 7}}
    assert resumed.steps == 1
    assert [resumed.train(batch, algorithm)["loss"] for _ in range(2)] == pytest.approx(
        expected, rel=1e-6)


@attrs.frozen
class SamplerState:
    position: int


@pytest.mark.parametrize("schedule, expected", [
    # fractions of the peak lr after each optimizer step: warmup 1 step, then down to 0 at the
    # 4th step and held there
    ("linear", [1.0, 2 / 3, 1 / 3, 0.0, 0.0]),
    ("constant", [1.0] * 5),
])
def test_a_decaying_schedule_ends_at_zero_on_the_runs_last_step(world, tiny_model_dir,
                                                                 schedule, expected):
    trainer = TrainEngine(tiny_model_dir, TrainConfig(
        optim=OptimizerConfig(lr=1e-2, warmup_steps=1, schedule=schedule),
        max_tokens_per_mb=200), total_steps=4)
    batch = fixed_batch(trainer.model.config.vocab_size)
    lrs = []
    for _ in range(5):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        lrs.append(trainer.train(batch, TokenNLL())["lr"] / 1e-2)
        moved = any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    assert lrs == pytest.approx(expected, abs=1e-9)
    assert moved == (schedule == "constant")  # at lr 0 the fifth step leaves the weights


def test_a_decaying_schedule_without_the_runs_length_is_an_error(world, tiny_model_dir):
    with pytest.raises(ValueError, match="optim.schedule='linear'.*needs total_steps"):
        TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(schedule="linear")))


def test_resume_restores_the_lr_schedule_the_step_count_and_the_rng(world, tiny_model_dir,
                                                                    tmp_path):
    """Besides weights and optimizer moments: mid-warmup, the next steps' learning rates are the
    straight run's, the step count goes on, random draws continue the same sequence, and the
    recipe's extra state comes back whatever its type."""
    def warming_up():
        return TrainEngine(tiny_model_dir, TrainConfig(
            optim=OptimizerConfig(lr=1e-2, warmup_steps=4), max_tokens_per_mb=200))

    algorithm = TokenNLL()
    straight = warming_up()
    batch = fixed_batch(straight.model.config.vocab_size)
    for _ in range(2):
        straight.train(batch, algorithm)
    # what a recipe keeps besides: any picklable object (a data order, a state class of its own)
    extra = {"order": np.arange(5), "sampler": SamplerState(position=7)}
    checkpoint.save_checkpoint(straight, tmp_path / "ckpt", extra_state=extra)
    drawn = torch.rand(8)  # what the run draws next
    lrs = [straight.train(batch, algorithm)["lr"] for _ in range(2)]

    torch.manual_seed(1234)  # a new process starts from another RNG state
    resumed = warming_up()
    restored = checkpoint.load_checkpoint(resumed, tmp_path / "ckpt")
    assert restored["sampler"] == SamplerState(position=7)
    assert restored["order"].tolist() == [0, 1, 2, 3, 4]
    assert resumed.steps == 2
    assert torch.equal(torch.rand(8), drawn)
    assert [resumed.train(batch, algorithm)["lr"] for _ in range(2)] == lrs
    assert resumed.steps == 4


def test_weight_sync_makes_the_local_engine_match_the_trainer(world, tiny_model_dir):
    trainer = engine(tiny_model_dir)
    batch = fixed_batch(trainer.model.config.vocab_size)
    trainer.train(batch, TokenNLL())
    pool = LocalEngine(tiny_model_dir)
    try:
        seconds = trainer.sync_weights(pool, 1)
        assert set(seconds) == {"sync/gather_seconds", "sync/send_seconds", "sync/bytes"}
        prompt = batch["input_ids"][0, :6].tolist()
        out = asyncio.run(pool.generate(GenerationRequest(
            input_ids=prompt, sampling=SamplingParams(max_new_tokens=8, temperature=0.8,
                                                      ignore_eos=True, seed=0))))
    finally:
        pool.close()
    ids = torch.tensor([[*prompt, *out.token_ids]])
    completion = torch.arange(ids.shape[1])[None, :] >= len(prompt)
    rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "loss_mask": completion, "temperature": torch.tensor([0.8])}
    from tensordict import TensorDict

    mine = trainer.forward(TensorDict(rows, batch_size=[1]))["logprobs"][0, len(prompt):]
    torch.testing.assert_close(torch.tensor(out.logprobs), mine, atol=1e-4, rtol=1e-4)
    assert set(out.versions) == {1}


def test_an_in_process_engine_generates_from_the_trainers_tensors(world, tiny_model_dir):
    """One copy of the weights: after the first sync the engine reads the trainer's parameters.
    While it decodes a long request, three optimizer steps change them in place; each engine
    step records its version label and a weight checksum. A label never sees two sets of
    weights (the optimizer step pauses the engine, the sync resumes it under the next version),
    and the request runs on under each new version."""
    trainer = engine(tiny_model_dir)
    pool = LocalEngine(tiny_model_dir, max_batch_size=4)
    seen: dict[int, set[float]] = {}
    try:
        assert trainer.shares_live_tensors
        trainer.sync_weights(pool, 0)
        mine = trainer.model.state_dict()
        assert all(t.data_ptr() == mine[k].data_ptr() for k, t in pool.model.state_dict().items())
        weight = mine["model.layers.0.mlp.down_proj.weight"]
        pool.on_step = lambda e: seen.setdefault(e.version, set()).add(float(weight.sum()))
        batch = fixed_batch(trainer.model.config.vocab_size)

        async def run():
            long = asyncio.create_task(pool.generate(GenerationRequest(
                input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=1000, ignore_eos=True,
                                                             seed=1))))
            for version in (1, 2, 3):
                while not seen.get(version - 1):  # until the engine decodes under this version
                    assert not long.done(), "the request ended before all updates"
                    await asyncio.sleep(0.001)
                await asyncio.to_thread(trainer.train, batch, TokenNLL())
                assert pool.paused  # by the optimizer step, until the sync
                await asyncio.to_thread(trainer.sync_weights, pool, version)
                assert not pool.paused
            return await long

        out = asyncio.run(run())
    finally:
        pool.close()
    assert set(seen) == {0, 1, 2, 3}
    assert all(len(sums) == 1 for sums in seen.values()), seen
    assert len({s for sums in seen.values() for s in sums}) == 4  # the weights did change
    assert list(out.versions) == sorted(out.versions) and out.versions[-1] == 3


def test_an_engine_on_the_trainers_tensors_repacks_them_at_each_sync(world, tiny_model_dir):
    """The engine reads packed copies of the trainer's live tensors (packed_weights, on a CPU),
    which the optimizer steps leave behind: after each sync it must generate what an engine
    given a copy of the trainer's weights then generates."""
    trainer = engine(tiny_model_dir)
    # packed even where the tiny model's small products would not pay (`packed_weights.pays`)
    pool = LocalEngine(tiny_model_dir, max_batch_size=4, pack_weights=True)
    if not pool.pack_weights:
        pool.close()
        pytest.skip("this CPU's oneDNN packs no fp32 weights")
    reqs = [GenerationRequest(input_ids=[5 + i, 6, 7], sampling=SamplingParams(
        max_new_tokens=12, ignore_eos=True, seed=i)) for i in range(3)]
    batch = fixed_batch(trainer.model.config.vocab_size)
    try:
        trainer.sync_weights(pool, 0)
        for version in (1, 2):
            trainer.train(batch, TokenNLL())
            trainer.sync_weights(pool, version)
            copy = LocalEngine(tiny_model_dir, max_batch_size=4)
            try:
                copy.update_weights(WeightUpdate(version=version, state_dict={
                    k: t.clone() for k, t in trainer.full_state_dict().items()}))
                expected = generate_together(copy, reqs)
            finally:
                copy.close()
            for out, exp in zip(generate_together(pool, reqs), expected, strict=True):
                assert out.token_ids == exp.token_ids
                torch.testing.assert_close(torch.tensor(out.logprobs),
                                           torch.tensor(exp.logprobs), atol=1e-5, rtol=0)
    finally:
        pool.close()


def test_a_copied_update_after_sharing_leaves_the_trainers_tensors_alone(world, tiny_model_dir):
    """An engine that shares the trainer's tensors, then gets weights to copy (a folder, another
    state dict), must copy them into tensors of its own, never into the trainer's."""
    trainer = engine(tiny_model_dir)
    pool = LocalEngine(tiny_model_dir, max_batch_size=4)
    try:
        trainer.sync_weights(pool, 0)
        before = trainer.full_state_dict()
        other = {k: t + 1.0 for k, t in before.items()}
        assert pool.update_weights(WeightUpdate(version=1, state_dict=other)) is False
        after = trainer.full_state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)
        assert all(torch.equal(t, other[k]) for k, t in pool.model.state_dict().items())
    finally:
        pool.close()


class Recorder(TokenNLL):
    """Declares every role and records what the runtime wrote into the batch before advantages."""

    roles = ("actor", "ref", "critic")

    def advantages(self, batch):
        self.seen = batch.clone()
        return batch

    def critic_loss(self, out, mb):
        from areal_flow.types import LossOutput

        mask = mb.loss_mask.float()
        return LossOutput(loss_sum=((out.values - 1.0) ** 2 * mask).sum(), normalizer=mask.sum(),
                          unit="tokens")


def test_role_forwards_fill_the_batch_and_the_critic_learns(world, tiny_model_dir):
    config = TrainConfig(optim=OptimizerConfig(lr=5e-2), max_tokens_per_mb=400)
    critic_config = TrainConfig(optim=OptimizerConfig(lr=3e-3), max_tokens_per_mb=400)
    actor = TrainEngine(tiny_model_dir, config)
    critic = TrainEngine(tiny_model_dir, critic_config, value=True)
    ref = TrainEngine(tiny_model_dir, config, trainable=False)
    batch = fixed_batch(actor.model.config.vocab_size)
    algorithm = Recorder()
    first = actor.train(batch, algorithm, critic=critic, ref=ref)
    seen = algorithm.seen
    mask = seen["loss_mask"]
    # before any update, the policy and the reference agree, and the fresh critic's head is zero
    torch.testing.assert_close(seen["prox_logprobs"][mask], seen["ref_logprobs"][mask])
    assert bool((seen["values"] == 0).all())
    expected = actor.forward(batch)  # after one step the policy moved away from the reference
    assert not torch.allclose(expected["logprobs"][mask], seen["ref_logprobs"][mask])
    losses = [first["critic/loss"]] + [actor.train(batch, algorithm, critic=critic,
                                                   ref=ref)["critic/loss"] for _ in range(5)]
    assert losses[-1] < losses[0] * 0.5


def test_warmup_and_a_non_finite_gradient_skip(world, tiny_model_dir):
    config = TrainConfig(optim=OptimizerConfig(lr=1e-2, warmup_steps=4), max_tokens_per_mb=400,
                         skip_nonfinite=True)  # without it the run stops (test_engine_steps.py)
    trainer = TrainEngine(tiny_model_dir, config)
    batch = fixed_batch(trainer.model.config.vocab_size)
    stats = trainer.train(batch, TokenNLL())
    assert stats["lr"] == pytest.approx(1e-2 / 4) and stats["grad_norm"] > 0

    class Exploding(TokenNLL):
        def loss(self, out, mb):
            result = super().loss(out, mb)
            return type(result)(loss_sum=result.loss_sum * float("inf"),
                                normalizer=result.normalizer, unit="tokens")

    before = trainer.full_state_dict()
    with pytest.warns(RuntimeWarning, match="step skipped"):
        stats = trainer.train(batch, Exploding())
    assert stats["skipped_step"] == 1.0 and trainer.steps == 1
    after = trainer.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bf16_and_activation_checkpointing_train(world, tiny_model_dir):
    base = TrainEngine(tiny_model_dir, TrainConfig(max_tokens_per_mb=400))
    checkpointed = TrainEngine(tiny_model_dir, TrainConfig(max_tokens_per_mb=400,
                                                           activation_checkpointing=True))
    bf16 = TrainEngine(tiny_model_dir, TrainConfig(max_tokens_per_mb=400, dtype="bfloat16"))
    batch = fixed_batch(base.model.config.vocab_size)
    calls = {}
    for e in (base, checkpointed):  # a layer's MLP runs twice with recomputation
        calls[e] = []
        e.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_, e=e: calls[e].append(1))
    for e in (base, checkpointed, bf16):
        e.train(batch, TokenNLL())
    assert len(calls[checkpointed]) == 2 * len(calls[base]) > 0
    grads = [e.full_grads() for e in (base, checkpointed, bf16)]
    assert max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0]) < 1e-6
    # bf16 compute: same direction, coarser numbers; master weights stay fp32
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in grads[0].values()]),
        torch.cat([g.flatten() for g in grads[2].values()]), dim=0)
    assert cos > 0.99
    assert all(t.dtype == torch.float32 for t in bf16.full_state_dict().values())


def test_weight_sync_through_a_folder(world, tiny_model_dir, tmp_path):
    trainer = engine(tiny_model_dir)
    batch = fixed_batch(trainer.model.config.vocab_size)
    trainer.train(batch, TokenNLL())
    pool = LocalEngine(tiny_model_dir)
    try:
        trainer.sync_weights(pool, 4, folder=tmp_path / "sync")
        assert pool.version == 4
        expected = trainer.full_state_dict()
        assert all(torch.equal(pool.model.state_dict()[k], v) for k, v in expected.items())
    finally:
        pool.close()


@pytest.mark.faults
def test_a_full_disk_while_checkpointing_names_the_space_and_removes_the_half_written_folder(
        world, tiny_model_dir, tmp_path, monkeypatch):
    """ENOSPC in the middle of a checkpoint (after the trainer's state, in the HF export): the
    error names the folder, the space a checkpoint takes and the space free; the partial folder
    is gone, so a resume takes the complete one before it."""
    import errno

    from areal_flow.run import RunDir
    from areal_flow.runtime import checkpoint

    run = RunDir(tmp_path / "run", keep_checkpoints=3)
    actor = engine(tiny_model_dir)
    first = run.save_checkpoint(1, actor, extra={"position": 1})

    def disk_full(trainer, folder, **kwargs):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_hf", disk_full)
    with pytest.raises(OSError, match=r"checkpoint .*step-000002 could not be written \(\[Errno "
                       r"28\] No space left on device\); a checkpoint takes \d+\.\d+ [MG]B "
                       r"\(step-000001\), and \d+\.\d+ [MG]B are free") as caught:
        run.save_checkpoint(2, actor, extra={"position": 2})
    assert caught.value.errno == errno.ENOSPC
    assert sorted(p.name for p in run.checkpoints.iterdir()) == [first.name]
    assert RunDir(tmp_path / "run", resume=True).resume_from == (1, first)


def test_a_run_folder_checkpoint_is_marked_whole_pruned_and_resumes_policy_and_critic(
        world, tiny_model_dir, tmp_path):
    """`RunDir.save_checkpoint` / `load_checkpoint` with real engines: the policy, the critic
    (in critic/), the extra state and the save_pretrained model, marked complete with every
    file in the manifest; the older checkpoint pruned; a resume restores both engines."""
    import json

    from areal_flow.run import COMPLETE, RunDir, checkpoint_damage

    def critic_engine():
        return TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2),
                                                       max_tokens_per_mb=200), value=True)

    run = RunDir(tmp_path / "run", keep_checkpoints=1)
    actor, critic = engine(tiny_model_dir), critic_engine()
    (run.checkpoint_dir(1) / "critic").mkdir(parents=True)  # left by a crash while saving step 1
    first = run.save_checkpoint(1, actor, extra={"position": 1}, critic=critic)
    assert run.has_checkpoint(1) and not run.has_checkpoint(2)
    with torch.no_grad():  # a critic unlike a fresh one (whose head is zero)
        dict(critic.model.named_parameters())["head.bias"].add_(1.0)
    second = run.save_checkpoint(2, actor, extra={"position": 2}, critic=critic,
                                 tokenizer_from=tiny_model_dir)
    assert not first.exists()
    assert sorted(p.name for p in second.iterdir()) == [
        COMPLETE, "critic", "dcp", "hf", "trainer_state.pt"]
    manifest = json.loads((second / COMPLETE).read_text())
    assert {"trainer_state.pt", "critic/trainer_state.pt", "hf/config.json",
            "hf/tokenizer.json"} <= set(manifest)
    assert checkpoint_damage(second) is None
    with pytest.raises(RuntimeError, match="resume=True"):
        run.load_checkpoint(actor)

    resumed_actor, resumed_critic = engine(tiny_model_dir), critic_engine()
    resumed = RunDir(tmp_path / "run", resume=True)
    assert resumed.load_checkpoint(resumed_actor, critic=resumed_critic) == (2, {"position": 2})
    for saved, loaded in ((actor, resumed_actor), (critic, resumed_critic)):
        want, got = saved.full_state_dict(), loaded.full_state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)


def test_the_memory_parts_are_the_weights_gradients_moments_and_the_engines_copies(
        world, tiny_model_dir):
    """memory/*_gb of the recipe's metrics (rl_recipes.memory_parts): counted from the tensors
    themselves, so a part that grows (a second copy, moments in fp32) shows."""
    from areal_flow.rl_recipes import memory_parts

    trainer = engine(tiny_model_dir)
    params = sum(p.numel() for p in trainer.model.parameters()) * 4 / 2**30  # fp32 master
    pool = LocalEngine(tiny_model_dir, dtype="float32")
    # on a CPU the engine's linear layers read packed copies of their weights (packed_weights)
    packed = pool.pack_weights * sum(m.weight.numel() * 4 for m in pool.model.modules()
                                     if type(m) is torch.nn.Linear) / 2**30
    try:
        parts = memory_parts(trainer, pool)
        assert parts["memory/weights_gb"] == pytest.approx(params)
        assert parts["memory/gradients_gb"] == pytest.approx(params)  # every weight is trained
        assert parts["memory/optimizer_gb"] == 0  # AdamW makes its moments at the first step
        assert parts["memory/engine_gb"] == pytest.approx(pool.weight_bytes / 2**30 + packed)
        assert parts["memory/kv_cache_gb"] == 0  # no rows held
        trainer.train(fixed_batch(trainer.model.config.vocab_size), TokenNLL())
        trainer.sync_weights(pool, 1)  # the engine now reads the trainer's own tensors
        parts = memory_parts(trainer, pool)
        assert parts["memory/optimizer_gb"] == pytest.approx(2 * params)  # two moments
        assert parts["memory/engine_gb"] == pytest.approx(packed)  # the packed copies only
    finally:
        pool.close()
    bf16 = LocalEngine(tiny_model_dir, dtype="bfloat16")
    try:  # with packing, the linear layers' packed copies on top of its own weights
        linears = sum(m.weight.numel() * 2 for m in bf16.model.modules()
                      if type(m) is torch.nn.Linear) / 2**30
        assert bf16.memory_gb() == pytest.approx(
            bf16.weight_bytes / 2**30 + (linears if bf16.pack_weights else 0))
    finally:
        bf16.close()
