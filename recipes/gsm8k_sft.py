"""Supervised fine-tuning on GSM8K's worked solutions, the loss on the assistant's tokens only.

    python recipes/gsm8k_sft.py                       # offline CPU default (packaged model + data)
    python recipes/gsm8k_sft.py --help                # every option
    torchrun --nproc-per-node 8 recipes/gsm8k_sft.py --model Qwen/Qwen2.5-1.5B-Instruct \\
        --dataset openai/gsm8k

Each row becomes a chat: the question as the user's turn, the worked solution (ending in
'#### N', the format the GRPO reward checks) as the assistant's. The loop: batch → update →
held-out NLL every `eval_every` steps → checkpoint. Rank 0 builds each batch; every rank trains.
"""

from __future__ import annotations

import math
import time

from typing import Any

import attrs
import torch
import torch.distributed as dist
import tyro
from attrs import validators as v
from transformers import AutoTokenizer

from areal_flow.algorithms.sft import SFT, SFTConfig
from areal_flow.config import OptimizerConfig
from areal_flow.data import offline
from areal_flow.data.sft import collate_sft
from areal_flow.process_memory import peak_rss_gb
from areal_flow.run import RunConfig
from areal_flow.runtime.distributed import exit_process
from areal_flow.runtime import precision
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.session import Session


@attrs.frozen(kw_only=True)
class Config(RunConfig):
    """SFT on GSM8K solutions. Defaults run offline on a CPU in about 5 minutes."""

    batch_size: int = attrs.field(default=8, validator=v.ge(1))
    """Conversations per optimizer step."""
    question_field: str = "question"
    """Dataset field with the user's turn."""
    answer_field: str = "answer"
    """Dataset field with the assistant's turn (the target)."""
    algorithm: SFTConfig = SFTConfig()
    train: TrainConfig = TrainConfig(optim=OptimizerConfig(lr=1e-5), max_tokens_per_mb=512,
                                     dtype="auto")  # see rl_recipes.RLConfig.train


def main(cfg: Config) -> None:
    with Session(cfg, "gsm8k_sft") as session:  # ranks, run folder, model, checkpoints, panel
        rank, world = session.rank, session.world
        tokenizer = AutoTokenizer.from_pretrained(session.model)
        # every rank reads the rows: each evaluates its own share of the held-out ones
        train_rows, eval_rows, data_note = offline.train_eval_rows(cfg.dataset, cfg.eval_size)
        train_chats = [conversation(cfg, row) for row in train_rows]
        eval_batch = collate_sft(tokenizer,
                                 [conversation(cfg, row) for row in eval_rows[rank::world]])
        algorithm = SFT(cfg.algorithm)
        trainer = TrainEngine(session.model, cfg.train,
                              total_steps=cfg.steps * cfg.train.ppo_minibatches)
        session.resume(trainer)
        cfg, measured = precision.measured(cfg, session.model, ("train", trainer))
        session.show(cfg, note=data_note, measured=measured, columns={
            "nll": "nll", "eval/nll": "eval nll", "grad_norm": "grad norm",
            "tokens_per_second": "tok/s", "seconds/step": "s/step"})

        if session.start == 0 and eval_rows:
            nll = heldout_nll(trainer, eval_batch)
            session.run.log_metrics(0, {"eval/nll": nll}) if rank == 0 else None
        for step in session.steps():
            began = time.perf_counter()
            batch = None
            if rank == 0:  # train() scatters rank 0's batch to every rank
                batch = collate_sft(tokenizer, [train_chats[i] for i in
                                                batch_indices(step, cfg, len(train_chats))])
            stats = trainer.train(batch, algorithm)
            evaluating = cfg.eval_size and ((step + 1) % cfg.eval_every == 0
                                            or step + 1 == cfg.steps)
            eval_nll = heldout_nll(trainer, eval_batch) if evaluating else None
            metrics = None
            if rank == 0:
                seconds = time.perf_counter() - began
                metrics = {**stats, "epoch": (step + 1) * cfg.batch_size / len(train_chats),
                           "seconds/step": seconds,
                           "tokens_per_second": batch["attention_mask"].sum().item() / seconds,
                           "memory/peak_rss_gb": peak_rss_gb()}
                if eval_nll is not None:
                    metrics["eval/nll"] = eval_nll
            session.end_step(step, metrics)  # logged; checkpointed when due; a stop ends it


def conversation(cfg: Config, row: dict) -> list[dict[str, str]]:
    """A dataset row as a user/assistant chat; a missing field is an error naming it."""
    for field in (cfg.question_field, cfg.answer_field):
        if field not in row:
            raise KeyError(f"a dataset row has no field {field!r} (it has {sorted(row)}): set "
                           "--question-field / --answer-field")
    return [{"role": "user", "content": str(row[cfg.question_field])},
            {"role": "assistant", "content": str(row[cfg.answer_field])}]


def batch_indices(step: int, cfg: Any, rows: int) -> list[int]:
    """The rows of `step` (`cfg.batch_size` of them): a fresh seeded shuffle every epoch, so a
    resumed run sees exactly the rows the uninterrupted run would have."""
    positions = range(step * cfg.batch_size, (step + 1) * cfg.batch_size)
    orders = {epoch: torch.randperm(rows, generator=torch.Generator().manual_seed(cfg.seed + epoch))
              for epoch in {position // rows for position in positions}}  # one shuffle an epoch
    return [int(orders[position // rows][position % rows]) for position in positions]


def heldout_nll(trainer: TrainEngine, eval_batch) -> float:
    """Mean NLL per target token over every rank's share of the held-out conversations."""
    logprobs = trainer.forward(eval_batch)["logprobs"]
    mask = eval_batch["loss_mask"]
    totals = torch.tensor([-(logprobs * mask).sum().item(), mask.sum().item()],
                          dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals[0] / totals[1]) if totals[1] > 0 else math.nan


if __name__ == "__main__":
    main(tyro.cli(Config))
    exit_process()  # skips interpreter finalization, which can abort after a good run
