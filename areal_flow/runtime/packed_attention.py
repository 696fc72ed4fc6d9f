"""Attention over packed rows, one row at a time.

A micro-batch reaches the model as one packed row (`layout.PackedRows`). transformers' sdpa then
attends through a dense block-diagonal causal mask over the whole pack: the work is quadratic in
the pack's tokens, though each token attends only within its own row, and on a CPU the kernel
walks every masked block. Measured on SmolLM2's shape (bf16, 2 cores): the attention backward was
the largest operation of a training step after the matrix products, and a 4,096-token pack
trained slower than seven 512-token ones. Here each row of the pack attends on its own, causally,
with no mask, work quadratic in each row's tokens only: each row's outputs and gradients are
those it gets alone, to 1e-5 (`tests/test_engine_steps.py`), but not bit for bit the mask's (in
fp32 one rank's gradients came 3e-5 from two ranks' that attended through the mask), so it is
off by default (`TrainConfig.packed_attention`). Where that saves less than half the mask's work (a pack of one or two rows: the
separate calls and the copies that join their outputs cost more than they save; a 512-token pack
of about two rows trained 10 % slower so), and in a forward without the rows' lengths (or with a
cache), transformers' masked sdpa runs, as before. The lengths come with the forward's keyword
arguments (`LENGTHS`, from `PackedRows.model_inputs`), which transformers hands to the attention
function.
"""

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
    """Switch `model` (transformers, sdpa) to `NAME`; masks are still built as sdpa's, for a
    forward that brings no lengths."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
