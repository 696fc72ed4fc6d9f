"""Run under torchrun by test_runtime.py: train a fixed batch for 3 steps and save the step-1
gradients, the step-3 parameters and the losses. argv: model_dir out_file loss_kind mb_tokens"""

from __future__ import annotations

import sys

import torch
from tensordict import TensorDict

from areal_flow.config import OptimizerConfig
from areal_flow.runtime.distributed import exit_process, shutdown_distributed
from areal_flow.runtime import checkpoint
from areal_flow.runtime.engine import TrainConfig, TrainEngine
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
        mask = mb.loss_mask.float()
        return LossOutput(loss_sum=-(out.logprobs * mask).sum(), normalizer=mask.sum(),
                          unit="tokens")


class SequenceNLL(TokenNLL):
    def loss(self, out, mb):
        mask = mb.loss_mask.float()
        per_seq = -(out.logprobs * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return LossOutput(loss_sum=per_seq.sum(), normalizer=len(per_seq), unit="sequences")


class WrongMicroBatchMean(TokenNLL):
    """The classic bug: averaging inside each micro-batch, then counting micro-batches."""

    def loss(self, out, mb):
        mask = mb.loss_mask.float()
        return LossOutput(loss_sum=-(out.logprobs * mask).sum() / mask.sum(), normalizer=1.0,
                          unit="sequences")


LOSSES = {"token": TokenNLL, "sequence": SequenceNLL, "wrong": WrongMicroBatchMean,
          "minibatches": TokenNLL}
MINIBATCHES = {"minibatches": 3, "checked": 2}
"""Optimizer steps per batch where not 1 (mini-batches must not depend on the world size)."""

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "scatter", "gather", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv")


def record_collective_devices(served: set[str]) -> dict:
    """Wrap torch's tensor collectives (object collectives and FSDP2 go through them too) to
    count the device types they receive and list those the group's backend would not serve."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    seen: dict = {"calls": {}, "violations": []}

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from tensors(item)

    def wrap(name, fn):
        def checked(*args, **kwargs):
            for t in tensors([*args, *kwargs.values()]):
                seen["calls"][t.device.type] = seen["calls"].get(t.device.type, 0) + 1
                if t.device.type not in served:
                    seen["violations"].append(f"{name} got a {t.device.type} tensor")
            return fn(*args, **kwargs)
        return checked

    for name in COLLECTIVES:
        checked = wrap(name, getattr(c10d, name))
        setattr(c10d, name, checked)
        setattr(dist, name, checked)
    return seen


class MemoryPool:
    """Stands in for the local engine on rank 0: takes the synced weights."""

    in_process = True

    def update_weights(self, update):
        self.version = update.version


def run_every_collective(engine, batch, out_file: str) -> None:
    """One pass through every collective path of the runtime and the run helpers."""
    from pathlib import Path

    from areal_flow.runtime.distributed import any_rank, same_on_all_ranks

    folder = same_on_all_ranks(str(Path(out_file).parent / "checked") if engine.rank == 0 else None)
    engine.train(batch, TokenNLL())
    engine.sync_weights(MemoryPool() if engine.rank == 0 else None, 1)
    any_rank(engine.rank == 1)
    Path(folder).mkdir(exist_ok=True)
    checkpoint.save_checkpoint(engine, folder)
    checkpoint.load_checkpoint(engine, folder)
    checkpoint.save_hf(engine, Path(folder) / "hf")

if __name__ == "__main__":
    model_dir, out_file, kind, mb_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    config = TrainConfig(optim=OptimizerConfig(lr=1e-2), max_tokens_per_mb=mb_tokens,
                         ppo_minibatches=MINIBATCHES.get(kind, 1))
    if kind == "checked":  # on a GPU machine, would every collective's tensor be served?
        from areal_flow.runtime.distributed import BACKENDS, served_device_types

        seen = record_collective_devices(served_device_types(BACKENDS["cuda"]))
    engine = TrainEngine(model_dir, config)
    batch = fixed_batch(engine.model.config.vocab_size) if engine.rank == 0 else None
    if kind == "checked":
        run_every_collective(engine, batch, out_file)
        torch.save(seen, f"{out_file}.{engine.rank}")
        shutdown_distributed()
        exit_process()
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
    exit_process()
