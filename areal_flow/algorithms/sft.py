"""Supervised fine-tuning: the negative log-likelihood of the target (assistant) tokens.

    L = −Σ_t m_t log π_θ(x_t | x_<t)   normalised per token (or per sequence first)

with m the loss mask (`areal_flow.data.sft` marks the assistant's tokens). No rollout, no
forward pass before the update (no roles), no advantages.
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import validators as v

from areal_flow.algorithms import algorithm
from areal_flow.algorithms import functional as F
from areal_flow.types import LossOutput, MicroBatch, ModelOutput


@attrs.frozen(kw_only=True)
class SFTConfig:
    """SFT options (default: the mean NLL over every target token of the batch)."""

    aggregation: Literal["token", "sequence"] = attrs.field(
        default="token", validator=v.in_(tuple(F.AGGREGATIONS)))
    """Average over all target tokens of the batch, or per conversation first."""


@algorithm("sft", config=SFTConfig)
class SFT:
    roles = ()

    def __init__(self, config: SFTConfig | None = None):
        self.config = config or SFTConfig()

    def advantages(self, batch):
        return batch

    def loss(self, out: ModelOutput, mb: MicroBatch) -> LossOutput:
        mask = mb.loss_mask
        nll = -F.masked(out.logprobs, mask)
        loss_sum, normalizer, unit = F.AGGREGATIONS[self.config.aggregation](nll, mask)
        mean = nll.detach().sum() / mask.sum().clamp(min=1)
        return LossOutput(loss_sum=loss_sum, normalizer=normalizer, unit=unit,
                          stats={"nll": mean})
