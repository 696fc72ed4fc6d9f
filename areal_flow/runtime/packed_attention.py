"""Attention over packed rows, one row at a time, or through the pack's mask.

sdpa attends through a pack's dense block-diagonal mask, quadratic in the pack's tokens (a
4,096-token pack trained slower than seven 512-token ones on a CPU). Here each row attends on its
own, unmasked: equal to the mask's to 1e-5, not bit for bit. Where that saves under half the
work, or a forward brings no row lengths (`LENGTHS`, from `PackedRows.model_inputs`),
transformers' masked sdpa runs.

On a CPU, in bf16, every attention a backward will run through is padded to one of a few lengths
(`_padded`): torch's CPU flash attention keeps the kernels its backward builds for each new
length for the life of the process (about 5 MB a length at SmolLM2's heads), so the lengths a run
meets grew its memory without bound (`python benchmarks/memory.py lengths`). The padding comes
last and is cut off, and no real query sees it: the real rows' outputs and gradients are
unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "areal_flow_packed_sdpa"
MASKED = "areal_flow_masked_sdpa"
LENGTHS = "packed_lengths"
"""The forward keyword that carries the pack's row lengths (a tuple of ints)."""
BUCKET = 32
"""Padded lengths are multiples of this, above 512 tokens of 1/16 of their power of two (2 % of
the attention's time at SmolLM2's rows; 64: 10 %)."""
KERNEL_CACHING_DEVICES = {"cpu"}


def _padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            mask: torch.Tensor | None) -> tuple:
    """query, key, value and mask padded after the last token where a bf16 backward on a CPU
    will run through them; real queries never see the padding, padded ones see nothing (torch's
    sdpa gives such rows zeros, not NaN: tested)."""
    n = query.shape[2]
    if query.device.type not in KERNEL_CACHING_DEVICES or query.dtype == torch.float32 or \
            not (torch.is_grad_enabled() and query.requires_grad) or key.shape[2] != n or \
            (mask is not None and mask.dtype != torch.bool):
        return query, key, value, mask
    pad = -n % max(BUCKET, 2 ** (n.bit_length() - 5))
    return (*(F.pad(t, (0, 0, 0, pad)) for t in (query, key, value)),
            None if mask is None else F.pad(mask, (0, pad, 0, pad)))


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                scaling: float | None = None, is_causal: bool | None = None, **kwargs
                ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (1, heads, tokens, dim), key and value
    (1, kv heads, tokens, dim); returns (1, tokens, heads, dim)."""
    lengths = kwargs.pop(LENGTHS, None)
    if lengths is None or query.shape[0] != 1 or key.shape[2] != query.shape[2] or \
            2 * sum(n * n for n in lengths) > query.shape[2] ** 2:  # saves under half the work
        return masked_sdpa(module, query, key, value, attention_mask, dropout, scaling,
                           is_causal, **kwargs)
    grouped = key.shape[1] != query.shape[1]
    rows = [_row(q, k, v, dropout, scaling, grouped)
            for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2),
                               value.split(lengths, 2))]
    return torch.cat(rows, 2).transpose(1, 2).contiguous(), None


def masked_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                scaling: float | None = None, is_causal: bool | None = None, **kwargs
                ) -> tuple[torch.Tensor, None]:
    """transformers' sdpa through the mask, padded (`_padded`); the rows' lengths unused."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop(LENGTHS, None)
    n = query.shape[2]
    out, _ = sdpa_attention_forward(module, *_padded(query, key, value, attention_mask),
                                    dropout=dropout, scaling=scaling, is_causal=is_causal,
                                    **kwargs)
    return out[:, :n], None


def _row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
         scaling: float | None, grouped: bool) -> torch.Tensor:
    """One row's causal attention (1, heads, tokens, dim)."""
    n = q.shape[2]
    q, k, v, _ = _padded(q, k, v, None)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling,
                                         is_causal=True, enable_gqa=grouped)
    return out[:, :, :n]


def use(model: torch.nn.Module, rows_alone: bool) -> None:
    """Switch `model` (transformers, sdpa) to `packed_sdpa` (`rows_alone`) or `masked_sdpa`;
    masks stay sdpa's, for a forward without lengths."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name, function = (NAME, packed_sdpa) if rows_alone else (MASKED, masked_sdpa)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
