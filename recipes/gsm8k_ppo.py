"""PPO on GSM8K: GRPO's asynchronous rollout loop with a learned critic (GAE advantages) and an
optional frozen reference model for a KL penalty.

    python recipes/gsm8k_ppo.py                       # offline CPU default (packaged model + data)
    python recipes/gsm8k_ppo.py --algorithm.kl-coef 0.05   # adds the reference model
    python recipes/gsm8k_ppo.py --help                # every option

The loop below is the whole algorithm: rollout → critic values, (reference logprobs) and GAE
advantages → actor and critic updates → weight sync → `scheduler.set_version` → eval /
checkpoint. Rank 0 drives the rollout; every rank trains both models.
"""

from __future__ import annotations

import time

import attrs
import torch.distributed as dist
import tyro
from transformers import AutoTokenizer

from areal_flow import gsm8k_rl, registry
from areal_flow.algorithms.ppo import PPO, PPOConfig
from areal_flow.config import OptimizerConfig, PolicyLossConfig, RolloutConfig, fast_bf16
from areal_flow.data import offline
from areal_flow.reward.runner import RewardRunner
from areal_flow.rollout.scheduler import RolloutScheduler
from areal_flow.run import LiveDisplay, RunDir, StopRequest
from areal_flow.runtime.distributed import (any_rank, exit_process, init_distributed,
                                            same_on_all_ranks, shutdown_distributed)
from areal_flow.runtime.engine import TrainConfig, TrainEngine


@attrs.frozen(kw_only=True)
class Config(gsm8k_rl.RLConfig):
    """PPO on GSM8K with a critic. Defaults run offline on a CPU in about 20 minutes."""

    # PPO needs no groups: 16 independent completions per step, like GRPO's 2 x 8
    rollout: RolloutConfig = RolloutConfig(batch_size=16, group_size=1, max_staleness=1,
                                           max_concurrent=32)
    # Skip the forward pass that recomputes pi_prox. With one optimizer step per batch, stale
    # tokens get pi_prox = pi_theta before the step (exact); tokens of the current version get
    # the engine's behavior logprobs (the same weights, but computed by the engine, in bf16 where
    # that is the default, so the ratio carries that rounding and may clip). Approximate with --train.ppo-minibatches > 1.
    algorithm: PPOConfig = PPOConfig(loss=PolicyLossConfig(recompute_proximal=False))
    critic: TrainConfig = TrainConfig(optim=OptimizerConfig(lr=5e-5), bf16=fast_bf16(),
                                      max_tokens_per_mb=512)  # as the actor's (gsm8k_rl)
    """The critic's training settings (a value head on the policy's backbone)."""


def main(cfg: Config) -> None:
    workflow_config = gsm8k_rl.workflow_config(cfg)  # bad names fail before any work
    pool_class = registry.generation_pools.get(cfg.inference.backend)
    rank, world, _ = init_distributed()
    run = RunDir(same_on_all_ranks(cfg.run_dir or RunDir.default_path("gsm8k_ppo")),
                 resume=cfg.resume, keep_checkpoints=cfg.keep_checkpoints)
    dist.barrier()  # every rank has checked the folder before rank 0 writes into it
    model = same_on_all_ranks(
        cfg.model or (str(offline.packaged_smollm2()) if rank == 0 else None))
    train_rows, eval_rows, data_note = gsm8k_rl.load_data(cfg, model, rank)  # before weights load
    algorithm = PPO(cfg.algorithm)
    trainer = TrainEngine(model, cfg.train)
    critic = TrainEngine(model, cfg.critic, value=True)
    ref = TrainEngine(model, cfg.train, trainable=False) if "ref" in algorithm.roles else None
    start, extra = run.load_checkpoint(trainer, critic=critic) if cfg.resume else (0, None)

    pool = scheduler = rewards = None
    display = LiveDisplay(cfg.steps, start, enabled=rank == 0, columns={
        "reward/mean": "reward", "format": "format", "work_shown": "work", "accuracy": "acc",
        "critic/value_loss": "value loss", "eval/accuracy": "eval acc",
        "reward_runner/failure_rate": "reward fails", "tokens_per_second": "tok/s",
        "staleness/mean": "staleness", "seconds/step": "s/step"})
    if rank == 0:
        run.truncate_after(start)
        display.print(f"[bold]gsm8k_ppo[/] run folder {run.path} · model {model} · "
                      f"{world} training rank(s)\n{data_note}")
        run.write_config(cfg)
        run.start_loggers(cfg.logger, cfg, start)
        pool = pool_class.from_config(cfg.inference, model=model, seed=cfg.seed,
                                      run_dir=run.path)
        rewards = RewardRunner(max_failure_rate=cfg.reward_failure_limit)
        scheduler = RolloutScheduler(
            pool=pool, workflow=cfg.workflow, dataset=train_rows,
            tokenizer=AutoTokenizer.from_pretrained(model), score=rewards.score,
            config=cfg.rollout, sampling=cfg.sampling, workflow_config=workflow_config,
            seed=cfg.seed)
        if extra:
            scheduler.load_state_dict(extra["scheduler"])
    weights = None if pool is None or pool.in_process else run.path / "weights"
    # servers start from the initial weights: give them the checkpoint's; an in-process engine
    # of the trainer's dtype then generates from the trainer's own tensors (no second copy)
    if start > 0 or pool_class.in_process:
        trainer.sync_weights(pool, start, folder=weights)

    try:
        with StopRequest() as stop, display:
            if scheduler is not None:
                scheduler.start()
                if start == 0:
                    run.log_metrics(0, gsm8k_rl.evaluate(cfg, scheduler, eval_rows))
            for step in range(start, cfg.steps):
                began = time.perf_counter()
                # rank 0 rolls out (the others get None); a stop or a rollout error while it
                # waits ends the run here, on every rank, after a checkpoint of where it stands
                batch = gsm8k_rl.next_batch(scheduler, stop, cfg.rollout.batch_timeout)
                if (halt := gsm8k_rl.halt(batch)) is not None:
                    if not run.has_checkpoint(step):
                        run.save_checkpoint(step, trainer, critic=critic, tokenizer_from=model,
                                            extra={"scheduler": scheduler.state_dict()
                                                   if scheduler else None})
                    if halt != gsm8k_rl.STOPPED:
                        raise batch if rank == 0 else RuntimeError(f"rank 0's rollout: {halt}")
                    display.print(f"stopped before step {step + 1}; continue with --resume "
                                  f"--run-dir {run.path}")
                    break
                rolled = time.perf_counter()
                # critic values (and ref logprobs) → GAE advantages → actor and critic updates
                stats = trainer.train(batch, algorithm, critic=critic, ref=ref)
                trained = time.perf_counter()
                sync = trainer.sync_weights(pool, step + 1, folder=weights)
                if scheduler is not None:
                    scheduler.set_version(step + 1)  # older rollouts now count as stale

                last = step + 1 == cfg.steps
                stopping = any_rank(stop.requested)
                if rank == 0:
                    metrics = {**gsm8k_rl.batch_metrics(cfg, batch, scheduler), **stats, **sync,
                               "seconds/rollout_wait": rolled - began,
                               "seconds/train": trained - rolled,
                               **gsm8k_rl.component_stats(rollout=scheduler, pool=pool,
                                                          reward_runner=rewards)}
                    metrics["seconds/step"] = time.perf_counter() - began
                    metrics["tokens_per_second"] = batch["attention_mask"].sum().item() / \
                        metrics["seconds/step"]
                    if cfg.eval_size and ((step + 1) % cfg.eval_every == 0 or last):
                        metrics.update(gsm8k_rl.evaluate(cfg, scheduler, eval_rows))
                    run.log_metrics(step + 1, metrics)
                    samples = gsm8k_rl.samples(cfg, batch, scheduler)
                    run.log_samples(step + 1, samples)
                    display.update(step + 1, metrics, samples[0]["completion"] if samples else None)
                if (step + 1) % cfg.save_every == 0 or last or stopping:
                    run.save_checkpoint(step + 1, trainer, critic=critic, tokenizer_from=model,
                                        extra={"scheduler": scheduler.state_dict()
                                               if scheduler else None})
                if stopping:
                    display.print(f"stopped after step {step + 1}; continue with --resume "
                                  f"--run-dir {run.path}")
                    break
        if rank == 0:
            display.print(f"done: {run.path}")
    finally:
        for part in (scheduler and scheduler.stop, pool and pool.close, rewards and rewards.close,
                     run.close):
            if part:
                part()
        shutdown_distributed()


if __name__ == "__main__":
    main(tyro.cli(Config))
    exit_process()  # skips interpreter finalization, which can abort after a good run
