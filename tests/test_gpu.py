"""The GPU path: what only a CUDA machine exercises (`pytest -m gpu`, run by scripts/gpu_check.sh).

Each test runs on the device `AREAL_FLOW_CHECK_DEVICE` names (cuda by default, skipped without a
GPU); `scripts/gpu_check.sh --cpu` sets it to cpu, so CI runs the same steps and they never rot.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_flow.types import SamplingParams

DEVICE = os.environ.get("AREAL_FLOW_CHECK_DEVICE", "cuda")
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs a GPU")]


def test_sampling_on_device_logits_with_cpu_generators_matches_the_cpu():
    from areal_flow.inference.sampling import sample

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
              SamplingParams(temperature=1.0, top_k=20)]
    for seed in range(5):
        def generators():
            return [torch.Generator().manual_seed(seed + i) for i in range(3)]

        cpu_tokens, cpu_logprobs = sample(logits, params, generators())
        tokens, logprobs = sample(logits.to(DEVICE), params, generators())
        assert tokens.cpu().tolist() == cpu_tokens.tolist()
        torch.testing.assert_close(logprobs.cpu(), cpu_logprobs, atol=1e-5, rtol=1e-5)


def test_every_collective_of_one_rank_gets_a_tensor_the_gpu_backend_serves(tiny_model_dir,
                                                                            tmp_path):
    """torchrun with one rank: on a GPU machine the group is `cpu:gloo,cuda:nccl` for real."""
    out = tmp_path / "seen.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                    str(ROOT / "tests" / "dist_train_script.py"), str(tiny_model_dir), str(out),
                    "checked", "64"], check=True, cwd=ROOT, timeout=300,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(  # keep the check's site
                       filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))})
    seen = torch.load(f"{out}.0")
    assert seen["violations"] == [] and seen["calls"], seen


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_bf16_fsdp2_step_trains_on_the_device(world, tiny_model_dir):
    from torch.distributed.tensor import DTensor

    from areal_flow.config import OptimizerConfig
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from tests.dist_train_script import TokenNLL, fixed_batch

    torch.manual_seed(0)
    engine = TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(lr=1e-2), dtype="bfloat16"))
    params = list(engine.model.parameters())
    assert all(isinstance(p, DTensor) and p.device.type == torch.device(DEVICE).type
               for p in params)
    before = {k: t.clone() for k, t in engine.full_state_dict().items()}
    batch = fixed_batch(engine.model.config.vocab_size)
    losses = [engine.train(batch.clone(), TokenNLL())["loss"] for _ in range(3)]
    after = engine.full_state_dict()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # the token NLL of a fixed batch falls
    assert all(p.dtype == torch.float32 for p in params)  # fp32 master weights
    assert sum(not torch.equal(before[k], after[k]) for k in before) == len(before)


def test_the_device_engine_generates_what_a_lora_trainer_exports(world, tiny_model_dir, tmp_path):
    from areal_flow.config import OptimizerConfig
    from areal_flow.inference.local import LocalEngine
    from areal_flow.lora import LoraConfig
    from areal_flow.runtime import checkpoint
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from tests.dist_train_script import TokenNLL, fixed_batch
    from tests.test_lora import engine_greedy, greedy_reference

    torch.manual_seed(0)
    trainer = TrainEngine(tiny_model_dir, TrainConfig(optim=OptimizerConfig(lr=5e-2),
                                                      lora=LoraConfig(rank=4, alpha=8)))
    batch = fixed_batch(trainer.model.config.vocab_size)
    for _ in range(2):
        trainer.train(batch.clone(), TokenNLL())
    checkpoint.save_hf(trainer, tmp_path / "export", tokenizer_from=tiny_model_dir)
    expected_tokens, expected_logprobs = greedy_reference(tmp_path / "export")  # on the CPU
    engine = LocalEngine(tiny_model_dir, device=DEVICE)
    try:
        trainer.sync_weights(engine, 3, folder=tmp_path / "weights")  # the adapter folder
        tokens, logprobs = engine_greedy(engine)
    finally:
        engine.close()
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-3)


def test_the_device_engine_continues_interrupted_generations_under_new_weights(tiny_model_dir):
    from tests.test_local_engine import check_interrupted_generations

    check_interrupted_generations(tiny_model_dir, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_mode", ["grad", "metric"])
@pytest.mark.parametrize("size", ["small", "smollm2"] if DEVICE.startswith("cuda") else ["small"])
def test_the_written_out_head_on_the_device_equals_the_categorical_distribution(
        dtype, entropy_mode, size):
    """The loss-position head's in-place log-softmax, entropy and gradient (logprobs.py) on the
    device against fp64 on the CPU; at SmolLM2's vocabulary and width (on a GPU only: 25 s on 2
    CPU cores) 1,500 positions run as three chunks. fp32's tolerance admits a GPU's reduction
    order, not TF32 (about 1e-3)."""
    from tests.test_logprobs import check_head_against_categorical

    shape = {} if size == "small" else dict(vocab=49152, n=1500, width=576)
    check_head_against_categorical(dtype, entropy_mode, DEVICE, fp32_tolerance=1e-4, **shape)
