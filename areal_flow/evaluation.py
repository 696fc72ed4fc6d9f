"""Rollout-only evaluation (`areal-flow eval`): a model served by a generation pool alone (no
trainer, no optimizer) runs a registered workflow and reward on dataset rows, one greedy episode
and `samples` sampled ones per row; it reports greedy pass@1, the unbiased pass@k of the samples
(Chen et al. 2021), mean rewards, response lengths and the task's own metrics."""

from __future__ import annotations

import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import attrs
from attrs import validators as v

from areal_flow.config import InferenceConfig, RolloutConfig
from areal_flow.types import Episode, SamplingParams, WeightUpdate, derived_seed


@attrs.frozen(kw_only=True)
class EvalConfig:
    """Evaluate a model on a registered workflow, reward and dataset with rollouts only (no
    trainer): greedy pass@1, pass@k of --samples sampled episodes (unbiased estimator), mean
    reward, response lengths and the task's metrics; per-row results to a jsonl, a summary
    beside it."""

    model: str | None = None
    """HF folder (a checkpoint's hf/ too) or hub id; default: the packaged SmolLM2-135M-Instruct."""
    dataset: str | None = None
    """As in the recipes (file, folder, hub dataset, reasoning_gym:<task>); default: the
    packaged GSM8K file."""
    split: Literal["train", "eval", "all"] = "eval"
    """The recipes' held-out rows (--eval-size of them, chosen as the recipes do), the rest, or
    every row."""
    eval_size: int = attrs.field(default=64, validator=v.ge(0))
    limit: int | None = attrs.field(default=None, validator=v.optional(v.ge(1)))
    """Evaluate only the first N rows of the split."""
    workflow: str = "rlvr"
    """A registered workflow (`areal-flow plugins`)."""
    workflow_config: str | None = None
    """The workflow's config: a YAML/JSON file or inline JSON (as in the recipes)."""
    reward: str | None = None
    """A registered reward; sets the workflow config's `reward` field."""
    samples: int = attrs.field(default=4, validator=v.ge(1))
    """Sampled episodes per row (n of pass@k)."""
    k: tuple[int, ...] = ()
    """The k of pass@k; default 1, 2, 4, ... up to --samples, and --samples itself."""
    temperature: float = attrs.field(default=1.0, validator=v.ge(0.0))
    """Sampling temperature of the sampled episodes (greedy ones use 0)."""
    max_new_tokens: int = attrs.field(default=128, validator=v.ge(1))
    """Token budget of each model turn."""
    correct_at: float = 1.0
    """An episode is correct when its reward is at least this."""
    max_concurrent: int = attrs.field(default=64, validator=v.ge(1))
    """Most episodes in flight; rows are run in chunks of max_concurrent // samples."""
    inference: InferenceConfig = attrs.field(factory=InferenceConfig)
    """As in the recipes: --inference.backend local|sglang, --inference.addresses host:port..."""
    out: str | None = None
    """Per-row results (jsonl; the summary beside it, <name>.summary.json); default
    evals/<task>-<time>.jsonl."""
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if too_big := [k for k in self.k if not 1 <= k <= self.samples]:
            raise ValueError(f"--k {' '.join(map(str, too_big))}: pass@k needs 1 <= k <= "
                             f"--samples ({self.samples}); raise --samples or lower --k")

    def __call__(self) -> int:
        """`areal-flow eval` with these options (tyro builds them, and shows a ValueError of
        the checks above as bad input); the exit status."""
        from rich.console import Console

        from areal_flow.cli import say
        from areal_flow.registry import RegistryError

        try:  # names, rows and the model's config are checked before any weights load
            plan = prepare(self)
        except (RegistryError, ValueError, OSError, ImportError) as exc:
            say(f"areal-flow eval: {exc}", error=True)
            return 2
        console = Console()
        summary = run(plan, console)
        say(headline(summary))
        console.print(table(summary))
        say(f"wrote {plan.out} and {summary_path(plan.out)} in {summary['seconds']:g} s "
            f"(peak memory {summary['peak_rss_gb']:.1f} GB)")
        return 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `c` correct of `n` samples, 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, HumanEval), in exact integers (C(n-c, k) = 0 when k > n - c)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n: n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks(cfg: EvalConfig) -> list[int]:
    n = cfg.samples
    return sorted(set(cfg.k) if cfg.k else {n, *(2 ** i for i in range(n.bit_length()))})


@attrs.frozen(kw_only=True)
class EvalPlan:
    """What `prepare` checked, for `run`: the options, the rows and where the results go."""

    cfg: EvalConfig
    rl: Any
    """The recipes' config (`rl_recipes.RLConfig`) the same options make."""
    workflow_config: Any
    pool_class: type
    rows: list[dict]
    model: str
    out: Path
    """The jsonl of per-row records (the summary goes beside it, `summary_path`)."""


def prepare(cfg: EvalConfig) -> EvalPlan:
    """Check names, rows and model before any weights load (errors name the option)."""
    from areal_flow import registry, rl_recipes
    from areal_flow.data import offline, packaged

    rl = rl_recipes.RLConfig(
        model=cfg.model, dataset=cfg.dataset, workflow=cfg.workflow, reward=cfg.reward,
        workflow_config=cfg.workflow_config, eval_size=cfg.eval_size, seed=cfg.seed,
        inference=cfg.inference, sampling=SamplingParams(max_new_tokens=cfg.max_new_tokens,
                                                         temperature=cfg.temperature),
        rollout=RolloutConfig(batch_size=1, group_size=1, max_concurrent=cfg.max_concurrent))
    workflow_config = rl_recipes.workflow_config(rl)  # unknown workflow or reward fails here
    pool_class = registry.generation_pools.get(cfg.inference.backend)
    try:
        train, held_out, _ = offline.train_eval_rows(cfg.dataset, 0 if cfg.split == "all"
                                                     else cfg.eval_size)
    except ValueError as error:  # e.g. --eval-size takes every row of a small file
        raise ValueError(f"--split {cfg.split}: {error} (--split all: every row)") from None
    rows = {"train": train, "eval": held_out, "all": train + held_out}[cfg.split]
    rows = rows[:cfg.limit]
    if not rows:
        raise ValueError(f"--split {cfg.split}: no rows (--eval-size {cfg.eval_size})")
    model = cfg.model or str(packaged.packaged_smollm2())
    rl_recipes.check_model(rl, model)
    task = rl_recipes.run_name(rl).removesuffix(f"_{rl.algorithm_name}")
    out = Path(cfg.out or Path("evals") / f"{task}-{datetime.now():%Y%m%d-%H%M%S}.jsonl")
    return EvalPlan(cfg=cfg, rl=rl, workflow_config=workflow_config, pool_class=pool_class,
                    rows=rows, model=model, out=out)


def row_record(index: int, row: dict, greedy: list[Episode], sampled: list[Episode],
               cfg: EvalConfig, tokenizer: Any) -> dict[str, Any]:
    """One row's results; a missing episode (its workflow kept failing) counts as reward 0."""
    from areal_flow.rl_recipes import transcript

    g = greedy[0] if greedy else None
    rewards = [float(ep.reward or 0.0) for ep in sampled]
    correct = sum(r >= cfg.correct_at for r in rewards)
    return {"index": index, "row": row,
            "completion": tokenizer.decode([t for seg in g.segments if seg.trainable
                                            for t in seg.token_ids], skip_special_tokens=True)
            if g else None,
            "transcript": transcript(g, tokenizer) if g else None,  # the whole exchange
            "reward": float(g.reward or 0.0) if g else 0.0,
            "length": g.num_trainable_tokens if g else None,
            "truncated": g.truncated if g else None,
            "metrics": dict(g.metrics) if g else {},
            "rates": sorted(g.rates) if g else [],  # which metrics are rates (0/1)
            "sampled_rewards": rewards,
            "sampled_lengths": [ep.num_trainable_tokens for ep in sampled],
            "sampled_truncated": [ep.truncated for ep in sampled],
            "sampled_missing": cfg.samples - len(sampled), "correct": correct,
            "pass@k": {str(k): pass_at_k(cfg.samples, correct, k) for k in ks(cfg)}}


def _lengths(lengths: list[int], truncated: list[bool]) -> dict[str, float]:
    if not lengths:
        return {"length_mean": 0.0, "length_p50": 0.0, "length_max": 0, "truncated_fraction": 0.0}
    return {"length_mean": sum(lengths) / len(lengths), "length_p50": statistics.median(lengths),
            "length_max": max(lengths), "truncated_fraction": sum(truncated) / len(truncated)}


def summarize(records: list[dict[str, Any]], cfg: EvalConfig) -> dict[str, Any]:
    """The summary of per-row records (what the summary json holds, less the run's facts).
    Means are over rows (greedy) or rows x samples (sampled); a missing episode counts as 0."""
    from areal_flow.rl_recipes import metric_means, wilson_interval

    n = len(records)
    solved = sum(r["reward"] >= cfg.correct_at for r in records)
    done = [r for r in records if r["length"] is not None]
    greedy = {"pass@1": solved / n, "pass@1_ci95": list(wilson_interval(solved, n)),
              "reward_mean": sum(r["reward"] for r in records) / n,
              **_lengths([r["length"] for r in done], [r["truncated"] for r in done]),
              "missing_episodes": n - len(done), "metrics": {}}
    rates = {name for r in records for name in r["rates"]}
    for name, (mean, interval) in metric_means([r["metrics"] for r in records], n,
                                               rates).items():
        greedy["metrics"][name] = mean
        if interval is not None:
            greedy["metrics"][f"{name}_ci95"] = list(interval)
    sampled = {"pass@k": {k: sum(r["pass@k"][k] for r in records) / n for k in map(str, ks(cfg))},
               "reward_mean": sum(sum(r["sampled_rewards"]) for r in records) / (n * cfg.samples),
               **_lengths([x for r in records for x in r["sampled_lengths"]],
                          [x for r in records for x in r["sampled_truncated"]]),
               "missing_episodes": sum(r["sampled_missing"] for r in records)}
    return {"rows": n, "correct": f"reward >= {cfg.correct_at:g}", "greedy": greedy,
            "sampled": sampled}


def run(plan: EvalPlan, console: Any = None) -> dict[str, Any]:
    """Serve the model with the pool, roll out every row, write the jsonl and the summary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from transformers import AutoTokenizer

    from areal_flow.reward.runner import RewardRunner
    from areal_flow.rollout.scheduler import RolloutScheduler
    from areal_flow.process_memory import peak_rss_gb

    cfg, rl, rows, out = plan.cfg, plan.rl, plan.rows, plan.out
    console = console or Console()
    began = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(plan.model)
    pool = plan.pool_class.from_config(cfg.inference, model=plan.model, seed=cfg.seed,
                                          run_dir=out.parent)
    if cfg.inference.addresses or cfg.inference.addresses_file:
        # servers attached by address may hold another run's weights: evaluate --model's
        pool.update_weights(WeightUpdate(version=0, path=str(plan.model)))
    rewards = RewardRunner(max_failure_rate=1.0)  # a failing reward scores its default
    greedy_sampling = attrs.evolve(rl.sampling, temperature=0.0)
    chunk = max(1, cfg.max_concurrent // cfg.samples)
    records: list[dict[str, Any]] = []
    try:
        scheduler = RolloutScheduler(
            pool=pool, workflow=cfg.workflow, dataset=rows, tokenizer=tokenizer,
            score=rewards.score, config=rl.rollout, sampling=rl.sampling,
            workflow_config=plan.workflow_config, seed=cfg.seed)
        scheduler.pause()  # admits no training groups: only rollout_batch runs
        with scheduler, ThreadPoolExecutor(1) as side, open(out, "w") as f, Progress(
                "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("rows", total=len(rows))
            for start in range(0, len(rows), chunk):
                part = rows[start:start + chunk]
                # rollout_batch seeds episodes by their place in the list it is given
                scheduler.seed = derived_seed(cfg.seed, "eval-chunk", start)
                greedy = side.submit(scheduler.rollout_batch, part, sampling=greedy_sampling)
                sampled = scheduler.rollout_batch(part, sampling=rl.sampling,
                                                  group_size=cfg.samples)
                done = [row_record(start + i, row, g, s, cfg, tokenizer)
                        for i, (row, g, s) in enumerate(zip(part, greedy.result(), sampled))]
                f.writelines(json.dumps(r, default=str) + "\n" for r in done)  # as they finish
                records += done
                progress.advance(task, len(part))
    finally:
        pool.close()
        reward_stats = rewards.stats()
        rewards.close()
    summary = {"model": plan.model, "workflow": cfg.workflow,
               "reward": getattr(plan.workflow_config, "reward", None),
               "dataset": cfg.dataset or "packaged GSM8K", "split": cfg.split,
               "samples": cfg.samples, "temperature": cfg.temperature,
               "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
               **summarize(records, cfg), "reward_failure_rate": reward_stats["failure_rate"],
               "seconds": round(time.perf_counter() - began, 1), "peak_rss_gb": peak_rss_gb()}
    summary_path(out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summary_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}.summary.json")


def headline(summary: dict[str, Any]) -> str:
    return (f"{summary['model']} · {summary['workflow']} / {summary['reward']} · "
            f"{summary['rows']} rows ({summary['split']}) · correct = {summary['correct']}")


def table(summary: dict[str, Any]) -> Any:
    """The printed summary: greedy and sampled columns, one row a number."""
    from rich.table import Table

    g, s = summary["greedy"], summary["sampled"]
    low, high = g["pass@1_ci95"]
    t = Table()
    t.add_column("")
    t.add_column("greedy")
    t.add_column(f"sampled (n={summary['samples']}, T={summary['temperature']:g})")
    t.add_row("pass@1", f"{g['pass@1']:.3f} (95% {low:.3f}-{high:.3f})",
              f"{s['pass@k']['1']:.3f}" if "1" in s["pass@k"] else "")
    for k, value in s["pass@k"].items():
        if k != "1":
            t.add_row(f"pass@{k}", "", f"{value:.3f}")
    t.add_row("mean reward", f"{g['reward_mean']:.3f}", f"{s['reward_mean']:.3f}")
    for key, label, form in (("length_mean", "length mean", ".1f"), ("length_p50", "length p50",
                             "g"), ("length_max", "length max", "d"),
                             ("truncated_fraction", "cut off at max tokens", ".3f")):
        t.add_row(label, format(g[key], form), format(s[key], form))
    for name, value in g["metrics"].items():
        if not name.endswith("_ci95"):
            t.add_row(name, f"{value:.3f}", "")
    return t
