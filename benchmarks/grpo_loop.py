"""The GRPO problems both end-to-end benchmarks run (trl_grpo.py, async_sync.py), and the
areal_flow side: the recipe's loop (rollout → train → weight sync → set_version) on the local
engine, one process per run, with what each step generated, trained and re-prefilled.

  tiny     the tiny random model, 4 prompts x 4 completions x 16 tokens, 30 steps; reward =
           fraction of completion tokens in a fixed id set (tests/test_learning.py), EOS never
           ends a completion.
  smollm2  (full runs only) SmolLM2-135M-Instruct on GSM8K rows in file order, the recipe's
           prompt, areal_flow.reward.gsm8k with format_weight 0.5 (the recipe's reward until
           2026-11-25: denser than its correctness-after-shown-work reward, so that the steps
           in these timings train instead of skipping flat groups), 2 prompts x 4 completions
           x 64 tokens.
fp32 weights for generation and training (unless the run names a precision), the RL recipes'
training settings (4,096-token packs, row attention, compile where it can), temperature 1.0,
constant lr, AdamW, grad-norm clip 1.0, no KL, one optimizer step per batch with no extra
forward pass for old logprobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
WORKER_ENV = "AREAL_FLOW_BENCH_WORKER"
TARGET = set(range(10, 60))  # the learnable reward of tests/test_learning.py
FORMAT_WEIGHT = 0.5  # a dense reward: few flat groups, so every timed step trains


def problems(quick: bool, tmp: Path, smollm2_steps: int, default_shape: bool = False) -> list[dict]:
    from areal_flow.testing.tiny_model import build_tiny_model

    out = [{"name": "tiny", "model": str(build_tiny_model(tmp / "tiny")), "prompts": 4,
            "group": 4, "max_new_tokens": 16, "lr": 1e-2, "steps": 30, "rows": 50, "seed": 0}]
    if not quick:
        from areal_flow.data.packaged import packaged_smollm2

        out.append({"name": "smollm2", "model": str(packaged_smollm2()), "prompts": 2,
                    "group": 4, "max_new_tokens": 64, "lr": 2e-5, "steps": smollm2_steps,
                    "seed": 0})
        if default_shape:  # the recipe's: 2 prompts x 8 completions x 128 tokens
            out.append({**out[-1], "name": "smollm2-2x8x128", "group": 8, "max_new_tokens": 128})
    return out


def tiny_rows(n: int) -> list[dict]:
    """Prompt ids as in tests/test_learning.py; TRL gets their text, which encodes back to them."""
    return [{"id": i, "prompt_ids": [1, 20 + i % 7, 30, 2]} for i in range(n)]


def target_fraction(ids) -> float:
    return sum(t in TARGET for t in ids) / max(len(ids), 1)


def gsm8k_rows(n: int) -> list[dict]:
    from areal_flow.data.packaged import gsm8k_offline_split

    train, _, _ = gsm8k_offline_split(16)  # the recipe's default split
    return train[:n]


def recipe_prompt() -> str:
    from areal_flow.rl_recipes import PROMPT

    return PROMPT


def steady(stamps: list[float]) -> list[float]:
    """Step durations from end-of-step time stamps (stamps[0] = loop start), without step 1."""
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]


def areal_flow_worker(p: dict, eta: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import (InferenceConfig, OptimizerConfig, PolicyLossConfig,
                                   RolloutConfig)
    from areal_flow.rl_recipes import hosting, next_batch
    from areal_flow.inference.local import LocalEngine
    from areal_flow.reward.runner import RewardRunner
    from areal_flow.stop_request import StopRequest
    from areal_flow.rollout.scheduler import RolloutScheduler
    from areal_flow.runtime.distributed import shutdown_distributed
    from areal_flow.rl_recipes import RLConfig
    from areal_flow.runtime.engine import TrainEngine
    from areal_flow.types import SamplingParams, WorkflowSpec
    from areal_flow.workflow.rlvr import RLVRConfig

    torch.manual_seed(p["seed"])
    started = time.perf_counter()
    tiny = p["name"] == "tiny"
    batch_rows = p["prompts"] * p["group"]
    # as the recipe builds it
    dtype = p.get("precision", "float32")  # "auto": the recipe's default, measured here
    engine = LocalEngine.from_config(
        InferenceConfig(dtype=dtype, max_batch_size=64, threads=p.get("engine_threads")),
        model=p["model"], seed=p["seed"])
    # the RL recipes' training settings (packs, row attention, compile), this run's lr and dtype
    recipe_train = attrs.fields(RLConfig).train.default
    trainer = TrainEngine(p["model"], attrs.evolve(
        recipe_train, optim=OptimizerConfig(lr=p["lr"]), dtype=dtype))
    # one optimizer step per batch: the version-based proximal logprobs are exact (the recipe's
    # choice), so no forward pass recomputes them; TRL skips that forward in this setting too
    algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False)))
    rewards = None
    if tiny:
        async def workflow_fn(ctx, sample):
            out = await ctx.generate(sample["prompt_ids"])
            return ctx.episode(sample["prompt_ids"], out, reward=target_fraction(out.token_ids))

        async def unused(*args, **kwargs):
            raise AssertionError

        workflow, score, dataset, workflow_config = \
            WorkflowSpec(name="bench.target_fraction", fn=workflow_fn), unused, \
            tiny_rows(p["rows"]), None
    else:
        rewards = RewardRunner()
        workflow, score, dataset = "rlvr", rewards.score, gsm8k_rows(p["prompts"] * p["steps"])
        workflow_config = RLVRConfig(reward_kwargs={"format_weight": FORMAT_WEIGHT},
                                     prompt_template=recipe_prompt())
    scheduler = RolloutScheduler(
        pool=engine, workflow=workflow, dataset=dataset,
        tokenizer=AutoTokenizer.from_pretrained(p["model"]), score=score,
        config=RolloutConfig(batch_size=p["prompts"], group_size=p["group"], max_staleness=eta,
                             max_concurrent=batch_rows * (eta + 1)),
        sampling=SamplingParams(max_new_tokens=p["max_new_tokens"], temperature=1.0,
                                ignore_eos=tiny),
        workflow_config=workflow_config, shuffle=False, seed=p["seed"])
    trainer.sync_weights(engine, 0)  # as the recipe: the engine then reads the trainer's weights
    loaded = time.perf_counter()
    steps, stamps = [], []
    engine.stats()  # count from here: nothing is generated before the scheduler starts
    try:
        with scheduler:
            stamps.append(time.perf_counter())
            for step in range(p["steps"]):
                began = time.perf_counter()
                # as the recipe waits: the engine's steps run on this thread meanwhile
                with StopRequest() as stop:
                    wait = next_batch(scheduler, stop, 600)
                if wait.halted:
                    raise wait.failure or KeyboardInterrupt()
                batch = wait.batch
                rolled = time.perf_counter()
                # as the recipe: the engine makes no step while this trains and syncs (unless
                # asked; `sync_hosted` False: the sync after the engine's thread restarted)
                def sync(version: int = step + 1) -> None:
                    trainer.sync_weights(engine, version)
                    scheduler.set_version(version)

                with hosting(engine, not p.get("decode_while_training", False)):
                    stats = trainer.train(batch, algorithm)
                    trained = time.perf_counter()
                    if p.get("sync_hosted", True):
                        sync()
                if not p.get("sync_hosted", True):
                    sync()
                stamps.append(time.perf_counter())
                completion = batch["loss_mask"].sum(-1)
                lag = (batch["policy_version"][:, None] - batch["versions"])[batch["loss_mask"]]
                pool, rollout = engine.stats(), scheduler.stats()
                steps.append({
                    "reward": batch["rewards"].float().mean().item(),
                    "rows": int(batch.batch_size[0]),
                    # rows of flat groups (advantage 0 everywhere) skip forward and backward
                    "trained_rows": int(batch.batch_size[0] - stats["train/skipped_rows"]),
                    "completion_tokens": int(completion.sum()),
                    "prompt_tokens": int((batch["attention_mask"].sum(-1) - completion).sum()),
                    "staleness": lag.float().mean().item(),
                    "max_staleness": int(lag.max()),
                    "generated_tokens": pool["generated_tokens"],
                    "reprefill_tokens": pool["reprefill_tokens"],
                    "interruptions": pool["interruptions"],
                    "dropped_stale_groups": rollout.get("dropped_stale_groups", 0),
                    "rollout_wait_s": rolled - began, "train_s": trained - rolled,
                    "sync_s": stamps[-1] - trained})
    finally:
        engine.close()
        if rewards is not None:
            rewards.close()
        shutdown_distributed()
    assert all(s["rows"] == batch_rows for s in steps), steps
    return {"load_s": loaded - started, "step_s": steady(stamps), "steps": steps,
            "wall_s": stamps[-1] - stamps[0], "torch_threads": torch.get_num_threads(),
            "precision": {"inference": engine.precision.describe(),
                          "train": trainer.precision.describe()}}


def launch(script: str, spec: dict, tmp: Path) -> dict:
    """Run one benchmark worker in a fresh process (`script` dispatches on WORKER_ENV)."""
    out, log = tmp / f"{spec['key']}.json", tmp / f"{spec['key']}.log"
    env = {**os.environ, WORKER_ENV: json.dumps({**spec, "out": str(out)}),
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    load = os.getloadavg()[0]
    with log.open("w") as f:
        done = subprocess.run([sys.executable, script], env=env, stdout=f,
                              stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        sys.stderr.write(log.read_text()[-6000:])
        raise SystemExit(f"{spec['key']} failed (exit {done.returncode}); its log is above")
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - started
    result["loadavg_1min"] = [load, os.getloadavg()[0]]
    print(f"  {spec['key']}: {result['process_s']:.0f} s", file=sys.stderr)
    return result


def worker_spec() -> dict | None:
    """The spec when this process is a benchmark worker, else None."""
    return json.loads(os.environ[WORKER_ENV]) if WORKER_ENV in os.environ else None


def summarize(problem: dict, label: str, result: dict) -> dict:
    steps = result["steps"]
    k = max(1, min(5, problem["steps"] // 3))
    rewards = [s["reward"] for s in steps]
    mean_step = sum(result["step_s"]) / len(result["step_s"])
    rows = problem["prompts"] * problem["group"]
    return {
        "model": problem["name"], "framework": label, "s_per_step": mean_step,
        "samples_per_s": rows / mean_step,
        "completion_tokens_per_s": sum(s["completion_tokens"] for s in steps[1:])
        / sum(result["step_s"]),
        "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
        # of the timed steps' rows, the fraction trained (None: TRL, which trains every row)
        "trained_fraction": sum(s["trained_rows"] for s in steps[1:])
        / sum(s["rows"] for s in steps[1:]) if "trained_rows" in steps[-1] else None,
        "reward_steps_averaged": k, "rewards": rewards, "step_s": result["step_s"],
        "load_s": result["load_s"], "process_s": result["process_s"], "steps": steps,
        "torch_threads": result["torch_threads"], "loadavg_1min": result["loadavg_1min"],
        "config": {k: v for k, v in problem.items() if k != "model"},
    }


def problem_label(row: dict) -> str:
    c = row["config"]
    return f"{row['model']} ({c['prompts']}x{c['group']}x{c['max_new_tokens']}, {c['steps']} steps)"
