"""The batch layout: algorithms see right-padded [rows, length] tensors, the model one packed
row (real tokens end to end, position ids restarting at 0 per row, which transformers turns into a
block-diagonal causal mask: no padding compute). `PackedRows` is the only code knowing both."""

from __future__ import annotations

import attrs
import torch

from areal_flow.runtime.packed_attention import LENGTHS


@attrs.frozen
class PackedRows:
    """A right-padded micro-batch as one packed row."""

    input_ids: torch.Tensor
    """[1, tokens]: every row's real tokens, row after row."""
    position_ids: torch.Tensor
    """[1, tokens]: each token's position in its row."""
    rows: torch.Tensor
    """[tokens]: the padded row of each packed token."""
    lengths: torch.Tensor
    """[rows]: each row's real tokens."""
    shape: tuple[int, int]
    """The padded [rows, length]."""

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
        mask = attention_mask.bool()
        if (mask[:, 1:] & ~mask[:, :-1]).any():
            raise ValueError("'attention_mask' must be right padding (each row's tokens from "
                             "column 0 on, then only padding): a 0 is followed by a 1")
        rows, cols = mask.nonzero(as_tuple=True)  # row-major: row after row, columns in order
        return cls(input_ids=input_ids[rows, cols][None], position_ids=cols[None], rows=rows,
                   lengths=mask.sum(1), shape=tuple(input_ids.shape))

    def model_inputs(self) -> dict:
        """The forward's keyword arguments. No cache: with one, transformers ignores restarting
        positions and tokens would attend across rows."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                # each row's tokens, for attention one row at a time (`packed_attention.py`;
                # other attention functions ignore it)
                LENGTHS: tuple(n for n in self.lengths.tolist() if n)}

    def index(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Positions in the packed row of padded (row, column) pairs (real tokens only)."""
        return (self.lengths.cumsum(0) - self.lengths)[rows] + cols

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, tokens] model output -> [rows, length], zeros at padding (gradients flow)."""
        return packed.new_zeros(self.shape).index_put((self.rows, self.position_ids[0]), packed[0])
