"""DPO (or IPO) on offline preference pairs: prefer the chosen response over the rejected one.

    python recipes/dpo.py                             # offline CPU default (packaged model + data)
    python recipes/dpo.py --help                      # every option
    torchrun --nproc-per-node 8 recipes/dpo.py --model Qwen/Qwen2.5-1.5B-Instruct \\
        --dataset my_pairs.jsonl --algorithm.beta 0.1

A dataset row is a pair: `prompt`, `chosen`, `rejected` (strings; other column names with
--prompt-field / --chosen-field / --rejected-field), as a jsonl file or a HF dataset. Each side
becomes a chat (the prompt as the user's turn, the response as the assistant's) and the loss
sees the assistant's tokens. The default pairs come from the packaged GSM8K rows: the worked
solution ending in '#### N' (the format the GRPO reward checks) is preferred over the same
solution ending in 'The answer is N.'. The loop: batch of pairs → reference and policy forward
→ update → held-out reward margin and accuracy every `eval_every` steps → checkpoint. Rank 0
builds each batch; every rank trains. Formulas: `areal_flow/extra_algorithms/dpo.py`.
"""

from __future__ import annotations

import time

import attrs
import torch
import torch.distributed as dist
import tyro
from attrs import validators as v
from transformers import AutoTokenizer

from areal_flow.extra_algorithms.dpo import DPO, DPOConfig, partners, sequence_logratio
from areal_flow.config import OptimizerConfig
from areal_flow.data import offline
from areal_flow.extra_algorithms.preference import collate_pairs, gsm8k_format_pairs, pair_from_row
from areal_flow.process_memory import peak_rss_gb
from areal_flow.run import RunConfig
from areal_flow.runtime.distributed import exit_process
from areal_flow.runtime import precision
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.session import Session
from gsm8k_sft import batch_indices  # the script's folder is on sys.path


@attrs.frozen(kw_only=True)
class Config(RunConfig):
    """DPO on preference pairs. Defaults run offline on a CPU (GSM8K answer-format pairs)."""

    steps: int = attrs.field(default=12, validator=v.ge(1))
    """Training steps (one batch of pairs each)."""
    eval_every: int = attrs.field(default=4, validator=v.ge(1))
    """Steps between evals (one also runs before training and after the last step)."""
    save_every: int = attrs.field(default=12, validator=v.ge(1))
    """Steps between checkpoints (one is also written at the end and on Ctrl-C / SIGTERM)."""
    batch_size: int = attrs.field(default=4, validator=v.ge(1))
    """Pairs per optimizer step (twice as many rows; each row costs a reference and a policy
    forward pass before the update, then the update's forward and backward)."""
    prompt_field: str = "prompt"
    """Dataset field with the user's turn."""
    chosen_field: str = "chosen"
    """Dataset field with the preferred response."""
    rejected_field: str = "rejected"
    """Dataset field with the dispreferred response."""
    algorithm: DPOConfig = DPOConfig()
    train: TrainConfig = TrainConfig(optim=OptimizerConfig(lr=1e-5), max_tokens_per_mb=512,
                                     dtype="auto")  # see rl_recipes.RLConfig.train


def main(cfg: Config) -> None:
    # every rank reads the rows: each evaluates its own share of the held-out pairs; a row
    # without the pair's fields is refused here, before any model loads
    train_pairs, eval_pairs, data_note = preference_pairs(cfg)
    with Session(cfg, "dpo") as session:  # ranks, run folder, model, checkpoints, panel
        rank, world = session.rank, session.world
        tokenizer = AutoTokenizer.from_pretrained(session.model)
        eval_batch = collate_pairs(tokenizer, eval_pairs[rank::world]) if eval_pairs else None
        algorithm = DPO(cfg.algorithm)
        trainer = TrainEngine(session.model, cfg.train,
                              total_steps=cfg.steps * cfg.train.ppo_minibatches)
        # the initial weights, also on resume (LoRA: its base)
        ref = trainer.reference(session.model)
        session.resume(trainer)
        cfg, measured = precision.measured(cfg, session.model, ("train", trainer))
        # the reference never changes: its held-out log-probs are computed once
        eval_ref = ref.forward(eval_batch)["logprobs"] if eval_batch is not None else None
        session.show(cfg, note=data_note, measured=measured, columns={
            "loss": "loss", "rewards/margin": "margin", "rewards/accuracy": "acc",
            "eval/margin": "eval margin", "eval/accuracy": "eval acc",
            "tokens_per_second": "tok/s", "seconds/step": "s/step"})

        if session.start == 0 and eval_pairs:
            scores = heldout(algorithm, trainer, eval_batch, eval_ref)
            session.run.log_metrics(0, scores) if rank == 0 else None
        for step in session.steps():
            began = time.perf_counter()
            batch = None
            if rank == 0:  # train() scatters rank 0's batch (whole pairs) to every rank
                batch = collate_pairs(tokenizer, [train_pairs[i] for i in
                                                  batch_indices(step, cfg, len(train_pairs))])
            stats = trainer.train(batch, algorithm, ref=ref)
            evaluating = eval_pairs and ((step + 1) % cfg.eval_every == 0
                                         or step + 1 == cfg.steps)
            scores = heldout(algorithm, trainer, eval_batch, eval_ref) if evaluating else {}
            metrics = None
            if rank == 0:
                seconds = time.perf_counter() - began
                metrics = {**stats, **scores,
                           "epoch": (step + 1) * cfg.batch_size / len(train_pairs),
                           "seconds/step": seconds,
                           "tokens_per_second": batch["attention_mask"].sum().item() / seconds,
                           "memory/peak_rss_gb": peak_rss_gb()}
            session.end_step(step, metrics)  # logged; checkpointed when due; a stop ends it


def preference_pairs(cfg: Config) -> tuple[list, list, str]:
    """Train and held-out pairs: the dataset's rows (each must have the three fields), or by
    default the packaged GSM8K rows turned into answer-format pairs."""
    train_rows, eval_rows, note = offline.train_eval_rows(cfg.dataset, cfg.eval_size)
    if cfg.dataset is None:
        train, held = gsm8k_format_pairs(train_rows), gsm8k_format_pairs(eval_rows)
        return train, held, f"{note}\npairs: each solution ending in '#### N' preferred over " \
                            "it ending in 'The answer is N.'"
    fields = (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field)
    return ([pair_from_row(r, *fields) for r in train_rows],
            [pair_from_row(r, *fields) for r in eval_rows], note)


def heldout(algorithm: DPO, trainer: TrainEngine, eval_batch, eval_ref) -> dict[str, float]:
    """Over every rank's share of the held-out pairs: the mean reward margin β·d, the fraction
    of pairs with d > 0 and the mean loss (d = h(chosen) − h(rejected), h = Σ log π − log π_ref)."""
    h = sequence_logratio(trainer.forward(eval_batch)["logprobs"], eval_ref,
                          eval_batch["loss_mask"]).double()
    chosen = eval_batch["chosen"]
    d = h[chosen] - h[partners(eval_batch["group_ids"])[0]][chosen]
    beta = algorithm.config.beta
    loss = algorithm.pair_loss(d, beta, algorithm.config.label_smoothing)
    totals = torch.tensor([beta * d.sum(), (d > 0).sum(), loss.sum(), len(d)],
                          dtype=torch.float64)
    dist.all_reduce(totals)
    margin, accuracy, loss, pairs = totals.tolist()
    return {"eval/margin": margin / pairs, "eval/accuracy": accuracy / pairs,
            "eval/loss": loss / pairs}


if __name__ == "__main__":
    main(tyro.cli(Config))
    exit_process()  # skips interpreter finalization, which can abort after a good run
