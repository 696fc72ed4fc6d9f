"""Training attention in bf16 on a CPU meets few lengths, and padding to them changes nothing.

torch's CPU flash attention keeps the kernels its bf16 backward builds for every length it meets,
never freeing them (about 5 MB a length at SmolLM2's heads), so `packed_attention` pads each
attention a backward will run through to one of a few lengths."""

from __future__ import annotations

import types

import pytest
import torch

from areal_flow.runtime import packed_attention
from areal_flow.runtime.packed_attention import BUCKET, LENGTHS, packed_sdpa

HEADS, KV_HEADS, DIM = 6, 2, 16
MODULE = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
"""What transformers' sdpa reads from the attention layer."""
SDPA = torch.nn.functional.scaled_dot_product_attention
"""torch's own, for the reference: the tests count the calls made through the module."""


def _pack(lengths: list[int], seed: int, requires_grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return [torch.randn(1, heads, n, DIM, generator=g, dtype=torch.bfloat16,
                        requires_grad=requires_grad) for heads in (HEADS, KV_HEADS, KV_HEADS)]


def _block_causal(lengths: list[int]) -> torch.Tensor:
    """The pack's mask as transformers builds it for sdpa: (1, 1, tokens, tokens), True = seen."""
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = len(row)
    return ((row[:, None] == row[None, :]) & torch.ones(n, n, dtype=torch.bool).tril())[None, None]


def _reference(q, k, v, lengths):
    """Each row alone through torch's sdpa, unpadded: (1, tokens, heads, dim)."""
    rows = [SDPA(a, b, c, is_causal=True, enable_gqa=True)
            for a, b, c in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))]
    return torch.cat(rows, 2).transpose(1, 2)


def _spy(monkeypatch) -> list[int]:
    seen: list[int] = []
    monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention",  # transformers' too
                        lambda q, *a, **k: seen.append(q.shape[2]) or SDPA(q, *a, **k))
    return seen


@pytest.mark.parametrize("path", ["rows", "mask"])
def test_bf16_training_attention_meets_a_length_per_bucket_with_outputs_and_gradients_unchanged(
        path, monkeypatch):
    """30 rows of 30 lengths (70..128 tokens) reach the kernel as 2 lengths, the mask's 15 pairs
    (142..254) as 4; each pack's output and the gradients of a loss over it match each row
    attended alone, unpadded (bf16 rounding apart)."""
    seen = _spy(monkeypatch)
    lengths = list(range(70, 130, 2))
    packs = [lengths[i : i + 2] for i in range(0, len(lengths), 2)]  # 2 rows: the mask's case
    for pack in packs if path == "mask" else [[n] for n in lengths]:
        q, k, v = _pack(pack, seed=sum(pack))
        mask = _block_causal(pack) if path == "mask" else None
        kwargs = {} if path == "mask" else {LENGTHS: tuple(pack)}
        out, _ = packed_sdpa(MODULE, q, k, v, mask, **kwargs)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((out.float() * weights).sum(), (q, k, v))
        want = _reference(q, k, v, pack)
        want_grads = torch.autograd.grad((want.float() * weights).sum(), (q, k, v))
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
        for name, got, ref in zip("qkv", grads, want_grads):
            assert torch.isfinite(got).all(), name
            torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2, msg=name)
    assert all(n % BUCKET == 0 for n in seen), seen
    assert len(set(seen)) <= (4 if path == "mask" else 2), sorted(set(seen))


def test_forwards_without_a_backward_and_fp32_attend_their_own_lengths(monkeypatch):
    """No backward (the role forwards, the engine's prefill) keeps no kernel per length, and
    fp32's backward keeps none: neither pays for padding."""
    seen = _spy(monkeypatch)
    q, k, v = _pack([70, 75, 91], seed=0, requires_grad=False)
    packed_sdpa(MODULE, q, k, v, None, **{LENGTHS: (70, 75, 91)})
    q, k, v = (t.float().requires_grad_() for t in _pack([70, 75, 91], seed=0))
    packed_sdpa(MODULE, q, k, v, None, **{LENGTHS: (70, 75, 91)})
    assert seen == [70, 75, 91] * 2


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rows_alone", [True, False], ids=["row-attention", "mask"])
def test_a_bf16_training_step_pads_its_attention_with_row_attention_on_or_off(
        world, tiny_model_dir, rows_alone, monkeypatch):
    """`TrainEngine`'s own forward in bf16, whatever `TrainConfig.packed_attention` says (SFT and
    DPO keep it off): every length the kernel meets is a padded one."""
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from tests.dist_train_script import fixed_batch

    e = TrainEngine(tiny_model_dir, TrainConfig(dtype="bfloat16", packed_attention=rows_alone))
    seen = _spy(monkeypatch)
    out = e.outputs(fixed_batch(e.model.config.vocab_size)[:5], entropy="grad")
    out.logprobs.sum().backward()
    assert seen and all(n % BUCKET == 0 for n in seen), seen
