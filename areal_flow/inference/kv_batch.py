"""The running batch's KV cache and mask, left-padded so every row's next token takes one column.
`slots`: keys and values are written in place into roomy buffers, not copied per step as by
`DynamicCache` (~55 MB per step at batch 8, 300 tokens, SmolLM2-135M)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW = 64
"""Columns of room added beyond what a slot layer needs when it grows (it at least doubles)."""

TRIM_AT = 0.25
"""Unneeded padding share of columns at which `KVBatch.keep` copies rows without it (0: always)."""


class SlotLayer(DynamicLayer):
    """A `DynamicLayer` over larger buffers: columns are written in place; full buffers grow."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        if old == 0 or new > self._room_keys.shape[-2]:  # grow, at least doubling
            width = max(2 * old, new + GROW)
            rooms = [states.new_empty((*states.shape[:2], width, states.shape[3]))
                     for states in (key_states, value_states)]
            if old:
                rooms[0][:, :, :old], rooms[1][:, :, :old] = self.keys, self.values
            self._room_keys, self._room_values = rooms
        self._room_keys[:, :, old:new] = key_states
        self._room_values[:, :, old:new] = value_states
        self.keys, self.values = self._room_keys[:, :, :new], self._room_values[:, :, :new]
        return self.keys, self.values

    def keep_rows(self, to: torch.Tensor, source: torch.Tensor, kept: int) -> None:
        """In place: move rows `source` to `to` (ascending, each lower: none lost), keep `kept`."""
        length = self.get_seq_length()
        if len(to):
            for room in (self._room_keys, self._room_values):
                room[to, :, :length] = room[source, :, :length]
        self._room_keys, self._room_values = self._room_keys[:kept], self._room_values[:kept]
        self.keys, self.values = self._room_keys[:, :, :length], self._room_values[:, :, :length]


class KVBatch:
    """The running rows' `cache` and `mask` (1 token, 0 padding), in the engine's running order."""

    def __init__(self, config, slots: bool = True):
        self.config = config
        self.slots = slots
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def clear(self) -> None:
        self.cache, self.mask = None, None

    def nbytes(self) -> int:
        """Bytes the keys and values hold, whole slot rooms included (a kept row's view keeps
        its room); safe to call from another thread while the engine steps."""
        cache = self.cache
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for layer in (cache.layers if cache is not None else ())
                    for t in (layer.keys, layer.values) if t is not None}.values())

    def wrap(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
        """A cache over per-layer (keys, values); with slots, plain layers become `SlotLayer`s."""
        cache = DynamicCache(ddp_cache_data=layers, config=self.config)
        if self.slots:
            for i, layer in enumerate(cache.layers):
                if type(layer) is DynamicLayer:
                    slot = SlotLayer()
                    slot.update(layer.keys, layer.values)
                    cache.layers[i] = slot
        return cache

    def rows(self, cache: DynamicCache, mask: torch.Tensor, rows: list[int], start: int = 0
             ) -> tuple[DynamicCache, torch.Tensor]:
        """The cache and mask of `rows` (may repeat: shared prefix copies) from column `start`."""
        index = torch.tensor(rows, device=mask.device)
        layers = [(layer.keys.index_select(0, index)[:, :, start:],
                   layer.values.index_select(0, index)[:, :, start:]) for layer in cache.layers]
        return self.wrap(layers), mask.index_select(0, index)[:, start:]

    def append(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add prefilled rows after the running ones; both are left-padded, so align right."""
        if self.cache is None:
            self.cache, self.mask = self.wrap([(a.keys, a.values) for a in cache.layers]), mask
            return
        width = max(self.mask.shape[1], mask.shape[1])

        def left_pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [missing, 0]) if missing else t

        self.cache = self.wrap([
            (torch.cat([left_pad(a.keys, 2), left_pad(b.keys, 2)]),
             torch.cat([left_pad(a.values, 2), left_pad(b.values, 2)]))
            for a, b in zip(self.cache.layers, cache.layers)])
        self.mask = torch.cat([left_pad(self.mask, 1), left_pad(mask, 1)])

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (ascending): slot rows move in place (a cache copy is 0.5 GB at 64x330
        bf16 SmolLM2 tokens) until padding reaches `TRIM_AT`; then copy, a layer at a time."""
        if not rows:
            self.clear()
            return
        index = torch.tensor(rows, device=self.mask.device)
        start = int(self.mask[index].any(0).nonzero()[0])
        if not all(type(layer) is SlotLayer for layer in self.cache.layers):
            self.cache, self.mask = self.rows(self.cache, self.mask, rows, start)
            return
        if start < TRIM_AT * self.mask.shape[1]:
            # each kept row to its new index, once for every layer
            moved = index != torch.arange(len(rows), device=index.device)
            to, source = moved.nonzero()[:, 0], index[moved]
            with torch.inference_mode():  # an abort keeps rows outside the step's inference mode
                for layer in self.cache.layers:
                    layer.keep_rows(to, source, len(rows))
            self.mask = self.mask.index_select(0, index)
            return
        for i, layer in enumerate(self.cache.layers):
            kept = SlotLayer()
            kept.update(layer.keys.index_select(0, index)[:, :, start:],
                        layer.values.index_select(0, index)[:, :, start:])
            self.cache.layers[i] = kept  # the old layer's buffers go now
            del layer
        self.mask = self.mask.index_select(0, index)[:, start:]

    def next_column(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Open every row's next-token column; returns the mask and those tokens' positions."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self), 1))], dim=1)
        return self.mask, self.mask.sum(1, keepdim=True) - 1


def left_padded(seqs: list[list[int]], pad_token_id: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `seqs`, left-padded to the longest, on the device."""
    width = max(map(len, seqs))
    ids = [[pad_token_id] * (width - len(seq)) + list(seq) for seq in seqs]
    mask = [[0] * (width - len(seq)) + [1] * len(seq) for seq in seqs]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: masked columns do not count."""
    return (mask.cumsum(1) - 1).clamp(min=0)
