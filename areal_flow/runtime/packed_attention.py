"""Attention over packed rows, one row at a time.

sdpa attends through a pack's dense block-diagonal mask, quadratic in the pack's tokens (a
4,096-token pack trained slower than seven 512-token ones on a CPU). Here each row attends on its
own, unmasked: equal to the mask's to 1e-5, not bit for bit. Where that saves under half the
work, or a forward brings no row lengths (`LENGTHS`, from `PackedRows.model_inputs`),
transformers' masked sdpa runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "areal_flow_packed_sdpa"
LENGTHS = "packed_lengths"
"""The forward keyword that carries the pack's row lengths (a tuple of ints)."""


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                scaling: float | None = None, is_causal: bool | None = None, **kwargs
                ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (1, heads, tokens, dim), key and value
    (1, kv heads, tokens, dim); returns (1, tokens, heads, dim)."""
    lengths = kwargs.pop(LENGTHS, None)
    if lengths is None or query.shape[0] != 1 or key.shape[2] != query.shape[2] or \
            2 * sum(n * n for n in lengths) > query.shape[2] ** 2:  # saves under half the work
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    grouped = key.shape[1] != query.shape[1]
    rows = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling,
                                           is_causal=True, enable_gqa=grouped)
            for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2),
                               value.split(lengths, 2))]
    return torch.cat(rows, 2).transpose(1, 2).contiguous(), None


def use(model: torch.nn.Module) -> None:
    """Switch `model` (transformers, sdpa) to `NAME`; masks stay sdpa's, for a forward without
    lengths."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
