"""Models an engine holds besides a causal LM policy: a critic; a LoRA policy's base (its ref)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict
from transformers import AutoModel

if TYPE_CHECKING:
    from areal_flow.runtime.engine import TrainEngine


class ValueModel(torch.nn.Module):
    """A causal LM's backbone with a scalar head: one value per position."""

    def __init__(self, path: str):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.config = self.backbone.config
        self._no_split_modules = getattr(self.backbone, "_no_split_modules", None)

    def forward(self, **inputs):
        hidden = self.backbone(**inputs).last_hidden_state
        # a fresh tensor: FSDP warns that in-place ops on a returned view would skip its hooks
        return self.head(hidden).squeeze(-1).clone()


class BaseModelRole:
    """A LoRA policy's base as a frozen role: `forward` runs the policy's engine, adapters off."""

    def __init__(self, engine: TrainEngine):
        self.engine = engine

    def forward(self, batch: TensorDict) -> TensorDict:
        # peft's own switch (enable_adapters) also flips the adapter's requires_grad, which
        # FSDP2 reads when it reduces gradients; the flag alone is what its forward checks
        layers = [m for m in self.engine.model.modules() if hasattr(m, "_disable_adapters")]
        for layer in layers:
            layer._disable_adapters = True
        try:
            return self.engine.forward(batch)
        finally:
            for layer in layers:
                layer._disable_adapters = False
