"""GRPO on GSM8K: asynchronous rollouts against a generation pool, FSDP2 training, weight sync.

    python recipes/gsm8k_grpo.py                      # offline CPU default (packaged model + data)
    python recipes/gsm8k_grpo.py --help               # every option
    torchrun --nproc-per-node 8 recipes/gsm8k_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct \\
        --dataset openai/gsm8k --inference.backend sglang --inference.server-gpus 8 9

The loop below is the whole algorithm: rollout → role forwards and advantages → update → weight
sync → `scheduler.set_version` → eval / checkpoint. Rank 0 drives the rollout; every rank trains.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import tyro
from attrs import validators as v

from areal_flow import registry
from areal_flow.algorithms.grpo import GRPO, GRPOConfig
from areal_flow.config import (InferenceConfig, OptimizerConfig, PolicyLossConfig, RolloutConfig,
                               load, structure)
from areal_flow.data import offline
from areal_flow.reward.gsm8k import extract_answer, has_answer_format
from areal_flow.reward.runner import RewardRunner
from areal_flow.rollout.scheduler import RolloutScheduler
from areal_flow.run import COMPLETE, LiveDisplay, RunDir, StopRequest
from areal_flow.runtime.engine import TrainConfig, TrainEngine, init_distributed, shutdown_distributed
from areal_flow.types import SamplingParams
from areal_flow.workflow.rlvr import RLVRConfig

PROMPT = ("Answer the question. Show short reasoning, then the final number after '####'.\n\n"
          "Example question: Tom has 3 apples and buys 2 more. How many apples does he have?\n"
          "Example answer: 3 + 2 = 5. #### 5\n\nQuestion: {question}\nAnswer:")
"""A one-shot prompt: SmolLM2-135M then writes '#### N' in about 1 completion of 6."""


@attrs.frozen(kw_only=True)
class Config:
    """GRPO on GSM8K. Defaults run offline on a CPU in about 20 minutes."""

    model: str | None = None
    """HF folder or hub id; default: the packaged SmolLM2-135M-Instruct (converted once)."""
    dataset: str | None = None
    """openai/gsm8k, a local json/jsonl/parquet file or a saved HF dataset; default: the packaged
    GSM8K file, split deterministically into train and eval."""
    eval_size: int = attrs.field(default=16, validator=v.ge(0))
    """Eval rows (greedy pass@1); 0 turns eval off."""
    eval_every: int = attrs.field(default=8, validator=v.ge(1))
    """Steps between evals (one also runs before training and after the last step)."""
    workflow: str = "rlvr"
    """A registered workflow (see `areal-flow plugins`)."""
    workflow_config: str | None = None
    """The workflow's config as a YAML/JSON file or inline JSON; default for rlvr: GSM8K with a
    0.5-weighted '#### N' format reward."""
    reward: str | None = None
    """Replaces the reward named in the workflow's config (a registered reward)."""
    answer_field: str = "answer"
    """Dataset field with the reference solution, for the accuracy metrics."""
    steps: int = attrs.field(default=24, validator=v.ge(1))
    """Training steps (one batch each)."""
    save_every: int = attrs.field(default=8, validator=v.ge(1))
    """Steps between checkpoints (one is also written at the end and on Ctrl-C / SIGTERM)."""
    samples_per_step: int = attrs.field(default=2, validator=v.ge(0))
    """Prompt/completion/reward triples written to samples.jsonl per step."""
    run_dir: str | None = None
    """Run folder; default runs/gsm8k_grpo-<time>."""
    resume: bool = False
    """Continue the run in --run-dir from its newest checkpoint."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    rollout: RolloutConfig = RolloutConfig(batch_size=2, group_size=8, max_staleness=1,
                                           max_concurrent=32)
    sampling: SamplingParams = SamplingParams(max_new_tokens=128, temperature=1.0)
    # one optimizer step per batch makes the version-based proximal logprobs exact, so the
    # forward pass that would recompute them is skipped
    algorithm: GRPOConfig = GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False))
    train: TrainConfig = TrainConfig(optim=OptimizerConfig(lr=2e-5), bf16=True)
    inference: InferenceConfig = InferenceConfig()

    def __attrs_post_init__(self) -> None:
        if self.resume and self.run_dir is None:
            raise ValueError("--resume needs --run-dir: the folder of the run to continue")


def main(cfg: Config) -> None:
    workflow_config = _workflow_config(cfg)  # unknown names and bad options fail before any work
    pool_class = registry.generation_pools.get(cfg.inference.backend)
    rank, world, _ = init_distributed()
    run = RunDir(_same_on_all_ranks(cfg.run_dir or RunDir.default_path("gsm8k_grpo"), rank),
                 resume=cfg.resume)
    dist.barrier()  # every rank has checked the folder before rank 0 writes into it
    model = _same_on_all_ranks(
        cfg.model or (str(offline.packaged_smollm2()) if rank == 0 else None), rank)
    algorithm = GRPO(cfg.algorithm)
    trainer = TrainEngine(model, cfg.train)
    ref = TrainEngine(model, cfg.train, trainable=False) if "ref" in algorithm.roles else None
    start, extra = 0, {}
    if cfg.resume:
        step, path = run.latest_checkpoint() or (0, None)
        if path is not None:
            extra = trainer.load_checkpoint(path) or {}
            start = step
            run.truncate_after(step) if rank == 0 else None

    pool = scheduler = rewards = None
    display = LiveDisplay(cfg.steps, start, enabled=rank == 0, columns={
        "reward/mean": "reward", "format": "format", "accuracy": "acc",
        "eval/accuracy": "eval acc", "tokens_per_second": "tok/s",
        "staleness/mean": "staleness", "seconds/step": "s/step"})
    if rank == 0:
        train_rows, eval_rows, data_note = _data(cfg)
        display.print(f"[bold]gsm8k_grpo[/] run folder {run.path} · model {model} · "
                      f"{world} training rank(s)\n{data_note}")
        run.write_config(cfg)
        pool = pool_class.from_config(cfg.inference, model=model, seed=cfg.seed,
                                      run_dir=run.path)
        rewards = RewardRunner()
        scheduler = RolloutScheduler(
            pool=pool, workflow=cfg.workflow, dataset=train_rows, tokenizer=_tokenizer(model),
            score=rewards.score, config=cfg.rollout, sampling=cfg.sampling,
            workflow_config=workflow_config, seed=cfg.seed)
        if extra:
            scheduler.load_state_dict(extra["scheduler"])
    weights = None if pool is None or pool.in_process else run.path / "weights"
    if start > 0:  # the pool starts from the initial weights; give it the checkpoint's
        trainer.sync_weights(pool, start, folder=weights)

    try:
        with StopRequest() as stop, display:
            if scheduler is not None:
                scheduler.start()
                if start == 0:
                    run.log_metrics(0, _evaluate(cfg, scheduler, eval_rows))
            for step in range(start, cfg.steps):
                began = time.perf_counter()
                batch = _next_batch(scheduler) if rank == 0 else None
                rolled = time.perf_counter()
                stats = _train(trainer, batch, algorithm, ref)
                trained = time.perf_counter()
                sync = trainer.sync_weights(pool, step + 1, folder=weights)
                if scheduler is not None:
                    scheduler.set_version(step + 1)

                last = step + 1 == cfg.steps
                stopping = _any_rank(stop.requested)
                if rank == 0:
                    metrics = {**_batch_metrics(cfg, batch, scheduler), **stats, **sync,
                               "seconds/rollout_wait": rolled - began,
                               "seconds/train": trained - rolled,
                               **_prefixed("rollout", scheduler.stats()),
                               **_prefixed("pool", pool.stats()),
                               **_prefixed("reward_runner", rewards.stats())}
                    metrics["seconds/step"] = time.perf_counter() - began
                    metrics["tokens_per_second"] = batch["attention_mask"].sum().item() / \
                        metrics["seconds/step"]
                    if cfg.eval_size and ((step + 1) % cfg.eval_every == 0 or last):
                        metrics.update(_evaluate(cfg, scheduler, eval_rows))
                    run.log_metrics(step + 1, metrics)
                    samples = _samples(cfg, batch, scheduler)
                    run.log_samples(step + 1, samples)
                    display.update(step + 1, metrics, samples[0]["completion"] if samples else None)
                if (step + 1) % cfg.save_every == 0 or last or stopping:
                    _checkpoint(run, trainer, model, step + 1, scheduler)
                if stopping:
                    display.print(f"stopped after step {step + 1}; continue with --resume "
                                  f"--run-dir {run.path}")
                    break
        if rank == 0:
            display.print(f"done: {run.path}")
    finally:
        for part in (scheduler and scheduler.stop, pool and pool.close, rewards and rewards.close):
            if part:
                part()
        shutdown_distributed()


# -- the pieces the loop calls --------------------------------------------------------------------


def _next_batch(scheduler: RolloutScheduler):
    """The next batch, or the error that stopped the rollout (every rank is told and stops)."""
    try:
        return scheduler.prepare_batch()
    except Exception as error:  # noqa: BLE001 - handed to train(), which raises it on all ranks
        return error


def _train(trainer: TrainEngine, batch, algorithm, ref) -> dict[str, float]:
    try:
        return trainer.train(batch, algorithm, ref=ref)
    except RuntimeError:
        if isinstance(batch, BaseException):
            raise batch from None  # rank 0 shows the rollout's own error
        raise


def _checkpoint(run: RunDir, trainer: TrainEngine, model: str, step: int, scheduler) -> None:
    """Exact-resume state (model, optimizer, schedule, RNG, scheduler position) and an HF model."""
    path = run.checkpoint_dir(step)
    path.mkdir(parents=True, exist_ok=True)
    extra = {"step": step, "scheduler": scheduler.state_dict() if scheduler else None}
    trainer.save_checkpoint(path, extra_state=extra)
    trainer.save_hf(path / "hf", tokenizer_from=model)
    if trainer.rank == 0:
        (path / COMPLETE).touch()


def _evaluate(cfg: Config, scheduler: RolloutScheduler, rows: list[dict]) -> dict[str, float]:
    """Greedy pass@1 on the eval rows, and the mean workflow reward."""
    if not rows:
        return {}
    greedy = attrs.evolve(cfg.sampling, temperature=0.0)
    groups = scheduler.rollout_batch(rows, sampling=greedy)
    tok = scheduler.tokenizer
    correct = formatted = scored = 0
    for row, episodes in zip(rows, groups):
        for episode in episodes:
            model_tokens = [t for t, m in zip(episode.token_ids, episode.loss_mask) if m]
            text = tok.decode(model_tokens, skip_special_tokens=True)
            grade = _grade(text, row.get(cfg.answer_field))
            correct += grade.get("accuracy", 0.0)
            formatted += grade.get("format", 0.0)
            scored += episode.reward
    n = max(len(rows), 1)
    return {"eval/accuracy": correct / n, "eval/format": formatted / n, "eval/reward": scored / n}


def _batch_metrics(cfg: Config, batch, scheduler) -> dict[str, float]:
    rewards = batch["rewards"].float()
    lengths = batch["loss_mask"].sum(-1).float()
    out = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
           "response_length/mean": lengths.mean().item(),
           "response_length/max": lengths.max().item()}
    grades = [_grade(text, scheduler.dataset[i].get(cfg.answer_field))
              for i, text in zip(batch["sample_ids"].tolist(), _completions(batch, scheduler))]
    for key in ("accuracy", "format"):
        values = [g[key] for g in grades if key in g]
        if values:
            out[key] = sum(values) / len(values)
    out["sample_ids"] = sorted(set(batch["sample_ids"].tolist()))  # for exact-resume checks
    lags = batch["policy_version"][:, None] - batch["versions"]
    out["staleness/mean"] = lags[batch["loss_mask"]].float().mean().item()
    return out


def _samples(cfg: Config, batch, scheduler) -> list[dict[str, Any]]:
    rows = range(min(cfg.samples_per_step, batch.batch_size[0]))
    completions = _completions(batch, scheduler)
    tok = scheduler.tokenizer
    out = []
    for i in rows:
        prompt_len = int(batch["loss_mask"][i].float().argmax())
        out.append({"prompt": tok.decode(batch["input_ids"][i, :prompt_len]),
                    "completion": completions[i], "reward": batch["rewards"][i].item()})
    return out


def _completions(batch, scheduler) -> list[str]:
    tok = scheduler.tokenizer
    return [tok.decode(ids[mask], skip_special_tokens=True)
            for ids, mask in zip(batch["input_ids"], batch["loss_mask"])]


def _grade(text: str, reference: Any) -> dict[str, float]:
    """GSM8K correctness and '#### N' format of a completion (empty without a reference)."""
    if reference is None:
        return {}
    expected = extract_answer(str(reference))
    return {"accuracy": float(expected is not None and extract_answer(text) == expected),
            "format": float(has_answer_format(text))}


def _data(cfg: Config) -> tuple[list[dict], list[dict], str]:
    if cfg.dataset is None:
        return offline.gsm8k_offline_split(cfg.eval_size)
    if Path(cfg.dataset).exists():  # one local file or folder: split it like the packaged one
        train, evaluation = offline.split_rows(offline.load_rows(cfg.dataset, "train"),
                                               cfg.eval_size)
    else:  # a hub dataset with train and test splits
        train = offline.load_rows(cfg.dataset, "train")
        evaluation = offline.load_rows(cfg.dataset, "test")[:cfg.eval_size]
    return train, evaluation, f"data: {cfg.dataset}, {len(train):,} train / " \
        f"{len(evaluation):,} eval rows"


def _workflow_config(cfg: Config) -> Any:
    spec = registry.workflows.get(cfg.workflow)
    if spec.config is None:
        if cfg.workflow_config or cfg.reward:
            raise ValueError(f"workflow {cfg.workflow!r} takes no config: drop --workflow-config "
                             "and --reward")
        return None
    if cfg.workflow_config is None:
        config = RLVRConfig(reward_kwargs={"format_weight": 0.5}, prompt_template=PROMPT) \
            if spec.config is RLVRConfig else spec.config()
    elif cfg.workflow_config.lstrip().startswith("{"):
        config = structure(spec.config, json.loads(cfg.workflow_config))
    else:
        config = load(spec.config, cfg.workflow_config)
    if cfg.reward is not None:
        if not hasattr(config, "reward"):
            raise ValueError(f"workflow {cfg.workflow!r} has no 'reward' option: drop --reward")
        registry.rewards.get(cfg.reward)  # an unknown name fails now, with suggestions
        config = attrs.evolve(config, reward=cfg.reward)
    return config


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _same_on_all_ranks(value: Any, rank: int) -> Any:
    """Rank 0's value everywhere (a default run folder's time stamp, the converted model)."""
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _prefixed(prefix: str, stats: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in stats.items()}


if __name__ == "__main__":
    main(tyro.cli(Config))
