"""Run under torchrun by test_runtime.py: train a fixed batch for 3 steps and save the step-1
gradients, the step-3 parameters and the losses. argv: model_dir out_file loss_kind mb_tokens"""

from __future__ import annotations

import sys

import torch
from tensordict import TensorDict

from areal_flow.config import OptimizerConfig
from areal_flow.runtime.engine import TrainConfig, TrainEngine, shutdown_distributed
from areal_flow.types import LossOutput


def fixed_batch(vocab: int) -> TensorDict:
    """6 groups of 2 rows with different lengths, the same on every run."""
    g = torch.Generator().manual_seed(0)
    rows, width = 12, 40
    lengths = torch.randint(8, width + 1, (rows,), generator=g)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    loss_mask = mask & (torch.arange(width)[None, :] >= 4)  # a 4-token prompt
    return TensorDict({
        "input_ids": ids * mask, "attention_mask": mask, "loss_mask": loss_mask,
        "logprobs": torch.zeros(rows, width), "versions": torch.zeros(rows, width, dtype=torch.long),
        "rewards": torch.zeros(rows), "group_ids": torch.arange(rows) // 2,
        "temperature": torch.ones(rows),
    }, batch_size=[rows])


class TokenNLL:
    roles = ()

    def advantages(self, batch):
        return batch

    def loss(self, out, mb):
        mask = mb["loss_mask"].float()
        return LossOutput(loss_sum=-(out.logprobs * mask).sum(), normalizer=mask.sum(),
                          unit="tokens")


class SequenceNLL(TokenNLL):
    def loss(self, out, mb):
        mask = mb["loss_mask"].float()
        per_seq = -(out.logprobs * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return LossOutput(loss_sum=per_seq.sum(), normalizer=len(per_seq), unit="sequences")


class WrongMicroBatchMean(TokenNLL):
    """The classic bug: averaging inside each micro-batch, then counting micro-batches."""

    def loss(self, out, mb):
        mask = mb["loss_mask"].float()
        return LossOutput(loss_sum=-(out.logprobs * mask).sum() / mask.sum(), normalizer=1.0,
                          unit="sequences")


LOSSES = {"token": TokenNLL, "sequence": SequenceNLL, "wrong": WrongMicroBatchMean}

if __name__ == "__main__":
    model_dir, out_file, kind, mb_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    config = TrainConfig(optim=OptimizerConfig(lr=1e-2), max_tokens_per_mb=mb_tokens)
    engine = TrainEngine(model_dir, config)
    batch = fixed_batch(engine.model.config.vocab_size) if engine.rank == 0 else None
    if kind == "fail":  # rank 0's rollout broke: every rank must stop, none may hang
        engine.train(RuntimeError("the rollout broke") if engine.rank == 0 else None, TokenNLL())
    algorithm = LOSSES[kind]()
    losses, grads = [], None
    for step in range(3):
        stats = engine.train(batch, algorithm)
        losses.append(stats["loss"])
        if step == 0:
            grads = engine.full_grads()
    params = engine.full_state_dict()
    if engine.rank == 0:
        torch.save({"grads": grads, "params": params, "losses": losses}, out_file)
    shutdown_distributed()
