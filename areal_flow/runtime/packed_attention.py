"""Attention over packed rows, one row at a time.

sdpa attends through a pack's dense block-diagonal mask, quadratic in the pack's tokens (a
4,096-token pack trained slower than seven 512-token ones on a CPU). Here each row attends on its
own, unmasked: equal to the mask's to 1e-5, not bit for bit. Where that saves under half the
work, or a forward brings no row lengths (`LENGTHS`, from `PackedRows.model_inputs`),
transformers' masked sdpa runs.

On a CPU, in bf16, every attention a backward will run through is padded to one of a few lengths
(`_padding`): torch's CPU flash attention keeps the kernels its backward builds for each new
length for the life of the process (about 5 MB a length at SmolLM2's heads), so the lengths a run
meets grew its memory without bound (`python benchmarks/memory.py lengths`). The padding comes
last and is cut off, and no real query sees it: the real rows' outputs and gradients are
unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "areal_flow_packed_sdpa"
LENGTHS = "packed_lengths"
"""The forward keyword that carries the pack's row lengths (a tuple of ints)."""
BUCKET = 32
"""Training attention's token counts on a CPU in bf16 are rounded up to a multiple of this, or
above 512 tokens of a sixteenth of their power of two: 16 lengths a doubling, at most 1/16 more
work. Padding to 16 cost nothing, to 32 2 % and to 64 10 % of the attention's time (rows of 150-350
tokens, SmolLM2's heads); 32 keeps 16 lengths under 512 tokens."""
KERNEL_CACHING_DEVICES = {"cpu"}
"""Device types whose reduced-precision attention backward keeps a kernel per length."""


def _padding(query: torch.Tensor) -> int:
    """Tokens to append so a backward through `query` meets a length it has met before."""
    if query.device.type not in KERNEL_CACHING_DEVICES or query.dtype == torch.float32 or \
            not (torch.is_grad_enabled() and query.requires_grad):
        return 0
    n = query.shape[2]
    return -n % max(BUCKET, 2 ** (n.bit_length() - 5))


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

        n, pad = query.shape[2], _padding(query)
        if pad and key.shape[2] == n and (attention_mask is None or
                                          attention_mask.dtype == torch.bool):
            query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
            if attention_mask is not None:  # real queries never see the padding; padded
                # queries see nothing: torch's sdpa gives such rows zeros, not NaN (tested)
                attention_mask = F.pad(attention_mask, (0, pad, 0, pad))
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask,
                                        dropout=dropout, scaling=scaling, is_causal=is_causal,
                                        **kwargs)
        return out[:, :n], None
    grouped = key.shape[1] != query.shape[1]
    rows = [_row(q, k, v, dropout, scaling, grouped)
            for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2),
                               value.split(lengths, 2))]
    return torch.cat(rows, 2).transpose(1, 2).contiguous(), None


def _row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
         scaling: float | None, grouped: bool) -> torch.Tensor:
    """One row's causal attention (1, heads, tokens, dim), padded after its last token."""
    n, pad = q.shape[2], _padding(q)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling,
                                         is_causal=True, enable_gqa=grouped)
    return out[:, :, :n]


def use(model: torch.nn.Module) -> None:
    """Switch `model` (transformers, sdpa) to `NAME`; masks stay sdpa's, for a forward without
    lengths."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
