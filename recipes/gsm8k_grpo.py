"""GRPO on GSM8K, or any registered algorithm on any workflow, reward and dataset:
asynchronous rollouts against a generation pool, FSDP2 training, weight sync.

    python recipes/gsm8k_grpo.py                      # offline CPU default (packaged model + data)
    python recipes/gsm8k_grpo.py --help               # every option
    python recipes/gsm8k_grpo.py --algorithm ppo      # any registered algorithm (`areal-flow plugins`)
    python recipes/gsm8k_grpo.py --algorithm distill --teacher BIGGER_MODEL   # on-policy distillation
    python recipes/gsm8k_grpo.py --dataset rows.jsonl --workflow my_task.solve \
        --algorithm my_task.rloo --algorithm.clip-eps 0.2    # a plugin's task, end to end
    torchrun --nproc-per-node 8 recipes/gsm8k_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct \
        --dataset openai/gsm8k --inference.backend sglang --inference.server-gpus 8 9

The loop below is the whole algorithm, a line per station: rollout → role forwards →
advantages → update → weight sync → `scheduler.set_version` (then metrics, eval, checkpoint).
Rank 0 drives the rollout; every rank trains. The panel and metrics.jsonl show the task's own
numbers (`Episode.metrics`, e.g. GSM8K's accuracy); run folders are
runs/<task>_<algorithm>-<time>.
"""

from __future__ import annotations

import time

import attrs
from transformers import AutoTokenizer

from areal_flow import registry, rl_recipes
from areal_flow.algorithms.grpo import GRPOConfig
from areal_flow.config import PolicyLossConfig
from areal_flow.reward.runner import RewardRunner
from areal_flow.rollout.scheduler import RolloutScheduler
from areal_flow.runtime.distributed import exit_process
from areal_flow.runtime import precision
from areal_flow.runtime.engine import TrainEngine
from areal_flow.session import Session


@attrs.frozen(kw_only=True)
class Config(rl_recipes.RLConfig):
    """GRPO on GSM8K. Defaults run offline on a 2-core CPU in about 10 minutes."""

    # Skip the forward pass that recomputes pi_prox. With one optimizer step per batch, stale
    # tokens get pi_prox = pi_theta before the step (exact); tokens of the current version get
    # the engine's behavior logprobs (the same weights, but computed by the engine, in bf16 where
    # that is the default, so the ratio carries that rounding and may clip). Approximate with --train.ppo-minibatches > 1.
    algorithm: GRPOConfig = GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False))


def main(cfg: Config) -> None:
    # e.g. RLVRConfig and GRPO(cfg.algorithm); a bad name or value fails before any work
    workflow_config, algorithm = rl_recipes.checked(cfg)
    pool_class = registry.generation_pools.get(cfg.inference.backend)
    if cfg.dry_run or cfg.allocation is not None:  # launch's part
        from areal_flow.launch import recipe as launch

        if cfg.dry_run:  # where each process would run, and how to start them; nothing is read
            return launch.dry_run(cfg)
        launch.check_launch(cfg)  # torchrun's world and this node's GPUs are --allocation's
    # ranks, run folder, model, checkpoints, the panel, stop requests, closing it all at the end
    with Session(cfg, rl_recipes.run_name(cfg)) as session:
        rank, model = session.rank, session.model
        train_rows, eval_rows, data_note = rl_recipes.load_data(  # before weights load
            cfg, model, rank, workflow_config)
        trainer = TrainEngine(model, cfg.train,
                              total_steps=cfg.steps * cfg.train.ppo_minibatches)
        ref = trainer.reference(model) if "ref" in algorithm.roles else None  # LoRA: its base
        critic = TrainEngine(model, cfg.critic, value=True,  # steps with each policy mini-batch
                             total_steps=cfg.steps * cfg.train.ppo_minibatches) \
            if "critic" in algorithm.roles else None
        teacher = TrainEngine(cfg.teacher, cfg.train, trainable=False) \
            if "teacher" in algorithm.roles else None  # --teacher, checked in load_data
        saved = session.resume(trainer, critic=critic)
        cfg, measured = precision.measured(cfg, model, ("train", trainer), ("critic", critic),
                                           in_process=pool_class.in_process)
        algorithm = rl_recipes.algorithm(cfg)  # with the mismatch correction the precisions chose
        session.show(cfg, note=data_note, measured=measured,
                     columns=rl_recipes.panel_columns(cfg, critic=critic is not None,
                                                    teacher=teacher is not None))

        pool = scheduler = rewards = None
        if rank == 0:  # rank 0 drives the rollout
            pool = pool_class.from_config(cfg.inference, model=model, seed=cfg.seed,
                                          run_dir=session.run.path,
                                          **({"lora": cfg.train.lora} if cfg.train.lora.enabled
                                             else {}))  # servers start with LoRA enabled
            session.closing(pool.close)
            rewards = RewardRunner(max_failure_rate=cfg.reward_failure_limit,
                                   max_calls_per_worker=cfg.reward_worker_max_calls,
                                   max_worker_rss_gb=cfg.reward_worker_max_rss_gb)
            session.closing(rewards.close)
            scheduler = RolloutScheduler(
                pool=pool, workflow=cfg.workflow, dataset=train_rows,
                tokenizer=AutoTokenizer.from_pretrained(model), score=rewards.score,
                config=cfg.rollout, sampling=cfg.sampling, workflow_config=workflow_config,
                seed=cfg.seed)
            session.closing(scheduler.stop)
            if saved:
                scheduler.load_state_dict(saved["scheduler"])
        stateful = hasattr(algorithm, "state_dict")  # e.g. GRPO's adaptive entropy coefficient
        if saved and stateful and saved.get("algorithm") is not None:
            algorithm.load_state_dict(saved["algorithm"])
        session.saved_also = lambda: {"scheduler": scheduler.state_dict() if scheduler else None,
                                      "algorithm": algorithm.state_dict() if stateful else None}
        weights = None if pool is None or pool.in_process else session.run.path / "weights"
        # launched servers start from the initial weights: give them the checkpoint's; servers
        # attached with --inference.addresses(-file) may hold another run's, so they get this
        # run's (labelled with its step); an in-process engine of the trainer's dtype then
        # generates from the trainer's own tensors (no second copy)
        if session.start > 0 or pool_class.in_process or cfg.inference.addresses or \
                cfg.inference.addresses_file:
            trainer.sync_weights(pool, session.start, folder=weights)

        if scheduler is not None:
            scheduler.start()
            if session.start == 0:
                session.run.log_metrics(0, rl_recipes.evaluate(cfg, scheduler, eval_rows,
                                                               run=session.run, step=0))
        entropy = rl_recipes.EntropyWatch()  # says so when the policy collapses
        for step in session.steps():
            began = time.perf_counter()
            # rollout: rank 0 waits for a batch (the others get None)
            wait = rl_recipes.next_batch(scheduler, session.stop, cfg.rollout.batch_timeout,
                                       host=cfg.inference.hosted)
            if wait.halted:  # a stop or a rollout error while it waited, on every rank
                session.stop_before(step, wait.failure)  # a checkpoint of where it stands
                break
            batch, rolled = wait.batch, time.perf_counter()
            # the in-process engine makes no step while this trains and syncs (it shares the
            # cores, and the sync would interrupt that step's rows and prefill them again)
            with rl_recipes.hosting(pool, not cfg.inference.decode_while_training):
                # role forwards: pi_prox, critic values, ref and teacher log-probs, as it needs
                shard = trainer.role_forwards(batch, algorithm, critic=critic, ref=ref,
                                              teacher=teacher)
                shard = trainer.advantages(shard, algorithm)  # on rank 0, the whole batch
                stats = trainer.update(shard, algorithm, critic=critic)  # the optimizer step(s)
                trained = time.perf_counter()
                failure = None  # what ends the run after this step trained: checkpoint it first
                try:
                    sync = trainer.sync_weights(pool, step + 1, folder=weights)  # weight sync
                    if scheduler is not None:
                        scheduler.set_version(step + 1)  # older rollouts now count as stale
                except Exception as error:  # noqa: BLE001 - e.g. servers gone mid-update
                    failure, sync = error, {}
            metrics = samples = None
            if rank == 0:
                metrics = {**rl_recipes.batch_metrics(cfg, batch, scheduler), **stats, **sync,
                           **rl_recipes.memory_parts(trainer, pool),
                           "seconds/rollout_wait": rolled - began,
                           "seconds/train": trained - rolled,
                           **rl_recipes.component_stats(rollout=scheduler, pool=pool,
                                                      reward_runner=rewards)}
                metrics["seconds/step"] = time.perf_counter() - began
                tokens = batch["attention_mask"].sum().item()
                metrics["tokens_per_second"] = tokens / metrics["seconds/step"]
                # the tokens the update trained (every mini-batch's step), not the batch's:
                # a step of flat groups trains none
                metrics["perf/mfu"] = trainer.mfu(
                    stats.get("train/tokens", 0.0) * cfg.train.ppo_minibatches,
                    metrics["seconds/train"])
                if "pool/decode_mbu" in metrics:  # an in-process engine's (servers: SGLang's)
                    metrics["perf/decode_mbu"] = metrics.pop("pool/decode_mbu")
                if cfg.eval_size and ((step + 1) % cfg.eval_every == 0
                                      or step + 1 == cfg.steps) and failure is None:
                    try:
                        metrics.update(rl_recipes.evaluate(cfg, scheduler, eval_rows,
                                                           run=session.run, step=step + 1))
                    except Exception as error:  # noqa: BLE001 - e.g. rewards over the limit
                        failure = error
                samples = rl_recipes.samples(cfg, batch, scheduler)
                if warning := entropy.check(metrics):
                    session.display.print(warning)
            # logged; checkpointed when due, on a stop and before a failure ends the run
            session.end_step(step, metrics, samples=samples, failure=failure)


if __name__ == "__main__":
    main(rl_recipes.cli(Config))
    exit_process()  # skips interpreter finalization, which can abort after a good run
