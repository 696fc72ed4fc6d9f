"""Attention for the local engine on a CPU: SDPA reading grouped key/value heads in place.

transformers' `sdpa` attention hands torch's kernel the grouped heads (`enable_gqa`) only when
the batch has no mask, because CUDA's kernels fall back to the slow math kernel for a masked call
with grouped heads; otherwise it repeats the key/value heads, or at one query packs the query
heads. The engine's batches of ragged prompts are left-padded, so masked. torch's CPU kernel
takes a mask with `enable_gqa` and gives bit-identical bf16 outputs. Measured per layer at batch
8 on SmolLM2's shape (bf16, the KV slots' views, 2 cores): the same at 120 keys; at 400 keys 129
against 150 us on a quiet machine, and 139 against 201 us with the other core busy (an engine
beside a trainer). End to end, at the decode benchmark's short contexts, the difference is
within its noise (`benchmarks/decode.py`'s rows). So on a CPU the engine uses this attention
(registered with transformers' attention interface as `NAME`; `LocalEngine(grouped_attention=)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "areal_flow_grouped_sdpa"
DEVICES = {"cpu"}
"""Device types whose SDPA kernel takes a mask together with grouped key/value heads."""


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                 scaling: float | None = None, is_causal: bool | None = None, **kwargs
                 ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (batch, heads, q, dim), key and value
    (batch, kv heads, k, dim), the mask `sdpa_mask` built; returns (batch, q, heads, dim)."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # without a mask (no padding, no cache before) the kernel's own causal masking applies
    causal = query.shape[2] > 1 and attention_mask is None and causal
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=causal, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def available(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether `model` on `device` can switch to `NAME`: a CPU, and transformers' sdpa in use."""
    return device.type in DEVICES and model.config._attn_implementation == "sdpa"


def use(model: torch.nn.Module) -> None:
    """Switch `model` to `NAME` (registered on first use, with sdpa's mask builder)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
