"""What the GSM8K RL recipes (`gsm8k_grpo.py`, `gsm8k_ppo.py`) share: the prompt, the config
fields besides the algorithm, and the pieces their loops call (batch metrics, samples, eval)."""

from __future__ import annotations

import json
from typing import Any

import attrs
from attrs import validators as v

from areal_flow import registry
from areal_flow.config import (InferenceConfig, OptimizerConfig, RolloutConfig, fast_bf16, load,
                               structure)
from areal_flow.algorithms.functional import flat_groups
from areal_flow.reward.gsm8k import extract_answer, has_answer_format
from areal_flow.rollout.scheduler import RolloutScheduler
from areal_flow.run import RunConfig, peak_rss_gb
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.types import SamplingParams
from areal_flow.workflow.rlvr import RLVRConfig

PROMPT = ("Answer the question. Show short reasoning, then the final number after '####'.\n\n"
          "Example question: Tom has 3 apples and buys 2 more. How many apples does he have?\n"
          "Example answer: 3 + 2 = 5. #### 5\n\nQuestion: {question}\nAnswer:")
"""A one-shot prompt: SmolLM2-135M then writes '#### N' in about 1 completion of 6."""


@attrs.frozen(kw_only=True)
class RLConfig(RunConfig):
    """An RL run on GSM8K; a recipe adds its `algorithm` (and models for other roles)."""

    workflow: str = "rlvr"
    """A registered workflow (see `areal-flow plugins`)."""
    workflow_config: str | None = None
    """The workflow's config as a YAML/JSON file or inline JSON; default for rlvr: GSM8K with a
    0.5-weighted '#### N' format reward."""
    reward: str | None = None
    """Replaces the reward named in the workflow's config (a registered reward)."""
    answer_field: str = "answer"
    """Dataset field with the reference solution, for the accuracy metrics."""
    samples_per_step: int = attrs.field(default=2, validator=v.ge(0))
    """Prompt/completion/reward triples written to samples.jsonl per step."""
    rollout: RolloutConfig = RolloutConfig(batch_size=2, group_size=8, max_staleness=1,
                                           max_concurrent=32)
    sampling: SamplingParams = SamplingParams(max_new_tokens=128, temperature=1.0)
    # 512-token micro-batches: on a CPU as fast as one big one, with a fraction of its
    # activations (benchmarks/train_step.py); raise --train.max-tokens-per-mb on GPUs
    train: TrainConfig = TrainConfig(optim=OptimizerConfig(lr=2e-5), bf16=fast_bf16(),
                                     max_tokens_per_mb=512)
    inference: InferenceConfig = InferenceConfig()


def workflow_config(cfg: RLConfig) -> Any:
    """The workflow's config from --workflow-config / --reward (names checked now)."""
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


def next_batch(scheduler: RolloutScheduler | None):
    """Rank 0: the next batch, or the error that stopped the rollout (handed to `train`, which
    raises it on every rank instead of leaving the others waiting). Other ranks: None."""
    if scheduler is None:
        return None
    try:
        return scheduler.prepare_batch()
    except Exception as error:  # noqa: BLE001 - re-raised by train() on all ranks
        return error


def train(trainer: TrainEngine, batch, algorithm, **roles) -> dict[str, float]:
    """`trainer.train`, showing rank 0 the rollout's own error when the batch is one."""
    try:
        return trainer.train(batch, algorithm, **roles)
    except RuntimeError:
        if isinstance(batch, BaseException):
            raise batch from None
        raise


def evaluate(cfg: RLConfig, scheduler: RolloutScheduler, rows: list[dict]) -> dict[str, float]:
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


def batch_metrics(cfg: RLConfig, batch, scheduler: RolloutScheduler) -> dict[str, Any]:
    """Reward, accuracy, format, response length and staleness of a trained batch."""
    rewards = batch["rewards"].float()
    lengths = batch["loss_mask"].sum(-1).float()
    out = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
           # groups whose rewards are all equal: no advantage, nothing to learn from
           "reward/flat_group_fraction": flat_groups(rewards, batch["group_ids"]).float().mean()
           .item(),
           "response_length/mean": lengths.mean().item(),
           "response_length/max": lengths.max().item()}
    grades = [_grade(text, scheduler.dataset[i].get(cfg.answer_field))
              for i, text in zip(batch["sample_ids"].tolist(), _completions(batch, scheduler))]
    for key in ("accuracy", "format"):
        values = [g[key] for g in grades if key in g]
        if values:
            out[key] = sum(values) / len(values)
    out["sample_ids"] = sorted(set(batch["sample_ids"].tolist()))  # for exact-resume checks
    out["memory/peak_rss_gb"] = peak_rss_gb()
    lags = batch["policy_version"][:, None] - batch["versions"]
    out["staleness/mean"] = lags[batch["loss_mask"]].float().mean().item()
    return out


def component_stats(**components: Any) -> dict[str, float]:
    """Every component's `stats()` under its name: rollout/..., pool/..., reward_runner/..."""
    return {f"{name}/{key}": float(value) for name, component in components.items()
            for key, value in component.stats().items()}


def samples(cfg: RLConfig, batch, scheduler: RolloutScheduler) -> list[dict[str, Any]]:
    """The first `samples_per_step` prompt/completion/reward triples of a batch."""
    completions = _completions(batch, scheduler)
    tok = scheduler.tokenizer
    out = []
    for i in range(min(cfg.samples_per_step, batch.batch_size[0])):
        prompt_len = int(batch["loss_mask"][i].float().argmax())
        out.append({"prompt": tok.decode(batch["input_ids"][i, :prompt_len]),
                    "completion": completions[i], "reward": batch["rewards"][i].item()})
    return out


def _completions(batch, scheduler: RolloutScheduler) -> list[str]:
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
