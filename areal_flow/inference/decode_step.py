"""The local engine's CPU decode step for Llama-family models, written out layer by layer.

On a CPU at SmolLM2's size about half of transformers' step is plumbing (~45 small ops per
layer). `DecodeStep` calls the same modules' `forward`s directly (packed weights, LoRA and updates
apply); with torch's attention kernel its logits equal transformers' bit for bit, with the
attention `faster_attention` measures to be faster they agree to float rounding
(tests/test_decode_paths.py). GPU steps are launch-bound."""

from __future__ import annotations

import functools
import time
import timeit

import torch
import torch.nn.functional as F

from areal_flow.inference import packed_weights

DEVICES = {"cpu"}


def supports(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether `DecodeStep` computes `model`'s decode step on `device` (else: transformers')."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    layers = getattr(getattr(model, "model", None), "layers", None)
    if device.type not in DEVICES or layers is None or not hasattr(model, "lm_head"):
        return False
    return all(isinstance(layer, (LlamaDecoderLayer, Qwen2DecoderLayer))
               and getattr(layer.self_attn, "sliding_window", None) is None  # full attention
               and isinstance(layer.mlp.act_fn, (SiLUActivation, torch.nn.SiLU))
               for layer in layers)


class DecodeStep:
    """`step(ids, positions, mask, cache)` -> next-token logits per row. ids, positions: (rows, 1);
    mask: (rows, columns), new column included; `cache`'s layers take the new keys and values."""

    def __init__(self, model: torch.nn.Module, rows: int = 16, attention: str | None = None):
        """`attention`: "sdpa" or "matmul" (None: the faster here, `faster_attention`, for
        batches of `rows`)."""
        base, config = model.model, model.config
        self._embed, self._rotary, self._norm = base.embed_tokens, base.rotary_emb, base.norm
        self._head = model.lm_head
        self._layers = list(base.layers)
        first = self._layers[0].self_attn
        self._heads, self._kv_heads = config.num_attention_heads, config.num_key_value_heads
        self._head_dim, self._scaling = first.head_dim, first.scaling
        self.attention = attention or faster_attention(
            model.dtype, self._heads, self._kv_heads, self._head_dim, rows)
        self._attend = ATTENTION[self.attention]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 cache) -> torch.Tensor:
        hidden = self._embed.forward(ids)
        cos, sin = self._rotary.forward(hidden, positions)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (rows, 1, 1, head_dim): every head
        # without padding every row attends to every column (one query: causal is all of them)
        attend = None if bool(mask.all()) else mask[:, None, None, :].bool()
        for layer, kv in zip(self._layers, cache.layers):
            hidden = self._layer(layer, hidden, cos, sin, attend, kv)
        return self._head.forward(_rms_norm(self._norm, hidden))[:, -1]

    def _layer(self, layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attend: torch.Tensor | None, kv) -> torch.Tensor:
        rows, attn, mlp = hidden.shape[0], layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, hidden)
        # queries and keys side by side (rows, 1, heads + kv heads, head_dim): one rotation
        width = (self._heads + self._kv_heads) * self._head_dim
        if (together := packed_weights.siblings(attn)) is not None:  # one product: q | k | v
            qkv = together.product(x)
            qk, v = qkv[..., :width], qkv[..., width:]
        else:
            qk = torch.cat([attn.q_proj.forward(x), attn.k_proj.forward(x)], dim=-1)
            v = attn.v_proj.forward(x)
        qk = qk.view(rows, 1, self._heads + self._kv_heads, self._head_dim)
        qk = qk * cos + _rotate_half(qk) * sin
        q = qk[:, :, :self._heads].transpose(1, 2)
        k = qk[:, :, self._heads:].transpose(1, 2)
        v = v.view(rows, 1, self._kv_heads, self._head_dim).transpose(1, 2)
        k, v = kv.update(k, v)
        out = self._attend(q, k, v, attend, self._scaling)
        hidden = hidden + attn.o_proj.forward(out.transpose(1, 2).reshape(rows, 1, -1))
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        if (together := packed_weights.siblings(mlp)) is not None:  # one product: gate | up
            gate, up = together.parts(x)
        else:
            gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
        return hidden + mlp.down_proj.forward(F.silu(gate) * up)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attend: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q (rows, heads, 1, dim), k and v (rows, kv heads, keys, dim), `attend` (rows, 1, 1, keys)
    or None -> (rows, heads, 1, dim): torch's fused kernel, transformers' numbers bit for bit."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attend: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`sdpa_attention` as two batched products: each key head's query heads are the rows of
    one product (grouped heads read in place), all in fp32 (probabilities rounded to bf16 before
    the values' product made bf16 rollouts learn worse on the tiny task). Where torch's CPU
    kernel has no fast path for one bf16 query (AVX-512 without AMX: 3-5x slower than this)."""
    rows, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    scores = torch.matmul(q.reshape(rows, kv_heads, heads // kv_heads, dim).float(),
                          k.float().transpose(-1, -2)).mul_(scale)
    if attend is not None:
        scores.masked_fill_(~attend, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(v.dtype).reshape(rows, heads, 1, dim)


ATTENTION = {"sdpa": sdpa_attention, "matmul": matmul_attention}

MARGIN = 0.8
"""`matmul` is chosen only below this fraction of `sdpa`'s time: where the two are close, a
run's choice (and so its sampled tokens) should not move with the timing noise."""


@functools.cache  # once a process: engines of one model then decode alike, whatever the noise
def faster_attention(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, rows: int,
                     keys: int = 256) -> str:
    """Times both decode attentions at this model's heads, `rows` queries over `keys` cached
    keys (a few ms) and names the faster: "sdpa" unless "matmul" takes under `MARGIN` of it."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, 1, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, keys, head_dim, generator=g).to(dtype) for _ in "kv")
    attend = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
    attend[0, ..., :keys // 4] = False  # a left-padded row, as a ragged batch has

    def seconds(name: str) -> float:  # the best of 7 calls (the first warms the kernel up)
        return min(timeit.repeat(lambda: ATTENTION[name](q, k, v, attend, head_dim ** -0.5),
                                 timer=time.perf_counter, number=1, repeat=7))

    with torch.inference_mode():
        sdpa, matmul = seconds("sdpa"), seconds("matmul")
    return "matmul" if matmul < MARGIN * sdpa else "sdpa"


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMSNorm (normalised in fp32, scaled in the model's dtype), fused."""
    normed = F.rms_norm(hidden.float(), hidden.shape[-1:], eps=norm.variance_epsilon)
    return norm.weight * normed.to(hidden.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
