"""End-to-end GRPO on this CPU: areal_flow against TRL's `GRPOTrainer`, the same problem in both.

Same model, data, prompt order, prompts per step, group size, max new tokens, temperature 1.0,
learning rate (constant, AdamW, grad-norm clip 1.0), steps; no KL; one optimizer step per batch,
with no extra forward pass for old logprobs in either; token-level loss (TRL's "dapo" = areal_flow's
"token" aggregation); group mean/std advantages; fp32 weights for generation and training.
  tiny     (--quick and full) the tiny random model, 4 prompts x 4 completions x 16 tokens, 30
           steps; reward = fraction of completion tokens in a fixed id set (tests/test_learning.py),
           EOS never ends a completion (areal_flow ignore_eos, TRL min_new_tokens).
  smollm2  (full only) SmolLM2-135M-Instruct on GSM8K rows in file order, the recipe's prompt and
           reward (areal_flow.reward.gsm8k with format_weight 0.5), 2 prompts x 4 completions x 64
           tokens, 3 steps.
areal_flow runs synchronously (max_staleness 0) and asynchronously (max_staleness 1). Each run is
its own subprocess, one after the other. s/step is the mean wall time of steps 2..N (model loading
and the first step are left out); samples/s = completions per step / s/step; ratio = areal_flow
samples/s / TRL samples/s; reward first→last = mean batch reward of the first and last k steps.
Differences left: TRL divides by the group's sample std (Bessel) + 1e-4, areal_flow by the
population std + 1e-6; the two sample with different random streams, so GSM8K completions (ended
by EOS) differ in length: the tok/s ratio column corrects for that; TRL's min_new_tokens takes
EOS out of the tiny model's sampling, areal_flow's ignore_eos samples it and goes on.

Install, in a venv of its own (TRL must stay out of the project's .venv):
    python3 -m venv .venv-bench && . .venv-bench/bin/activate
    pip install torch==2.13.0                  # the CPU build where pip finds one
    pip install -e '.[demo]' -c benchmarks/constraints.txt
    pip install -r benchmarks/requirements.txt # trl==1.16.0, torch/transformers pinned

    OMP_NUM_THREADS=2 python benchmarks/trl_grpo.py [--quick] [--out FILE]
                                     (default benchmarks/results/trl_grpo.json)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER_ENV = "AREAL_FLOW_TRL_GRPO_WORKER"
INSTALL = ("python3 -m venv .venv-bench && . .venv-bench/bin/activate && "
           "pip install torch==2.13.0 && pip install -e '.[demo]' -c benchmarks/constraints.txt && "
           "pip install -r benchmarks/requirements.txt")

TARGET = set(range(10, 60))  # the learnable reward of tests/test_learning.py
FORMAT_WEIGHT = 0.5  # the recipe's default rlvr config


def problems(quick: bool, tmp: Path) -> list[dict]:
    from areal_flow.testing.tiny_model import build_tiny_model

    out = [{"name": "tiny", "model": str(build_tiny_model(tmp / "tiny")), "prompts": 4,
            "group": 4, "max_new_tokens": 16, "lr": 1e-2, "steps": 30, "rows": 50}]
    if not quick:
        from areal_flow.data.offline import packaged_smollm2

        out.append({"name": "smollm2", "model": str(packaged_smollm2()), "prompts": 2,
                    "group": 4, "max_new_tokens": 64, "lr": 2e-5, "steps": 3})
    return out


# -- the two problems' data and rewards, shared by both frameworks ---------------------------------


def tiny_rows(n: int) -> list[dict]:
    """Prompt ids as in tests/test_learning.py; TRL gets their text, which encodes back to them."""
    return [{"id": i, "prompt_ids": [1, 20 + i % 7, 30, 2]} for i in range(n)]


def target_fraction(ids) -> float:
    return sum(t in TARGET for t in ids) / max(len(ids), 1)


def gsm8k_rows(n: int) -> list[dict]:
    from areal_flow.data.offline import gsm8k_offline_split

    train, _, _ = gsm8k_offline_split(16)  # the recipe's default split
    return train[:n]


def recipe_prompt() -> str:
    sys.path.insert(0, str(ROOT))
    from areal_flow.gsm8k_rl import PROMPT

    return PROMPT


def steady(stamps: list[float]) -> list[float]:
    """Step durations from end-of-step time stamps (stamps[0] = loop start), without step 1."""
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]


# -- workers (each in its own process) -------------------------------------------------------------


def areal_flow_worker(p: dict, eta: int) -> dict:
    import torch

    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import OptimizerConfig, PolicyLossConfig, RolloutConfig
    from areal_flow.inference.local import LocalEngine
    from areal_flow.reward.runner import RewardRunner
    from areal_flow.rollout.scheduler import RolloutScheduler
    from areal_flow.runtime.engine import TrainConfig, TrainEngine, shutdown_distributed
    from areal_flow.types import SamplingParams, WorkflowSpec
    from areal_flow.workflow.rlvr import RLVRConfig
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    started = time.perf_counter()
    tiny = p["name"] == "tiny"
    batch_rows = p["prompts"] * p["group"]
    engine = LocalEngine(p["model"], dtype="float32", seed=0, max_batch_size=64)
    trainer = TrainEngine(p["model"], TrainConfig(optim=OptimizerConfig(lr=p["lr"]), bf16=False))
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
        workflow_config=workflow_config, shuffle=False, seed=0)
    loaded = time.perf_counter()
    steps, stamps = [], []
    try:
        with scheduler:
            stamps.append(time.perf_counter())
            for step in range(p["steps"]):
                began = time.perf_counter()
                batch = scheduler.prepare_batch(timeout=600)
                rolled = time.perf_counter()
                trainer.train(batch, algorithm)
                trained = time.perf_counter()
                trainer.sync_weights(engine, step + 1)
                scheduler.set_version(step + 1)
                stamps.append(time.perf_counter())
                completion = batch["loss_mask"].sum(-1)
                lag = (batch["policy_version"][:, None] - batch["versions"])[batch["loss_mask"]]
                steps.append({
                    "reward": batch["rewards"].float().mean().item(),
                    "rows": int(batch.batch_size[0]),
                    "completion_tokens": int(completion.sum()),
                    "prompt_tokens": int((batch["attention_mask"].sum(-1) - completion).sum()),
                    "staleness": lag.float().mean().item(),
                    "rollout_wait_s": rolled - began, "train_s": trained - rolled,
                    "sync_s": stamps[-1] - trained})
    finally:
        engine.close()
        if rewards is not None:
            rewards.close()
        shutdown_distributed()
    assert all(s["rows"] == batch_rows for s in steps), steps
    return {"load_s": loaded - started, "step_s": steady(stamps), "steps": steps,
            "torch_threads": torch.get_num_threads()}


def trl_worker(p: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    started = time.perf_counter()
    tiny = p["name"] == "tiny"
    tokenizer = AutoTokenizer.from_pretrained(p["model"])
    steps: list[dict] = []

    if tiny:
        rows = tiny_rows(p["rows"])
        prompts = [tokenizer.decode(r["prompt_ids"]) for r in rows]
        for text, row in zip(prompts, rows):  # TRL tokenizes the text: the same ids
            assert tokenizer(text=[text])["input_ids"][0] == row["prompt_ids"], text
        dataset = Dataset.from_list([{"prompt": t} for t in prompts])

        def reward(completions, completion_ids, **kwargs):
            return [target_fraction(ids) for ids in completion_ids]
    else:
        from areal_flow.reward.gsm8k import gsm8k

        template = recipe_prompt()
        dataset = Dataset.from_list([
            {"prompt": [{"role": "user", "content": template.format(question=r["question"])}],
             "answer": r["answer"]} for r in gsm8k_rows(p["prompts"] * p["steps"])])

        def reward(completions, answer, **kwargs):
            return [gsm8k(c[0]["content"], answer=a, format_weight=FORMAT_WEIGHT)
                    for c, a in zip(completions, answer)]

    class Trainer(GRPOTrainer):
        """Times generation + scoring, and records each batch's reward and token counts."""

        def _generate_and_score_completions(self, inputs):
            began = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            steps.append({"rows": int(out["completion_ids"].shape[0]),
                          "completion_tokens": int(out["completion_mask"].sum()),
                          "prompt_tokens": int(out["prompt_mask"].sum()),
                          "generate_and_score_s": time.perf_counter() - began})
            return out

    def logged_reward(completions, **kwargs):
        values = reward(completions, **kwargs)
        logged_reward.batches.append(sum(values) / len(values))
        return values

    logged_reward.batches = []
    logged_reward.__name__ = "reward"

    class Clock(TrainerCallback):
        def __init__(self):
            self.stamps: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

    batch_rows = p["prompts"] * p["group"]
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, max_steps=p["steps"], seed=0, use_cpu=True,
            per_device_train_batch_size=batch_rows, gradient_accumulation_steps=1,
            steps_per_generation=1, num_iterations=1, num_generations=p["group"],
            max_completion_length=p["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
            generation_kwargs={"min_new_tokens": p["max_new_tokens"]} if tiny else None,
            beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
            learning_rate=p["lr"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
            bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False,
            shuffle_dataset=False, report_to=[], logging_steps=1, save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0)
        clock = Clock()
        trainer = Trainer(model=p["model"], reward_funcs=logged_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
        loaded = time.perf_counter()
        trainer.train()
    # one generation of prompts x group completions and one optimizer step per training step
    assert len(steps) == len(logged_reward.batches) == len(clock.stamps) - 1 == p["steps"]
    assert all(s["rows"] == batch_rows for s in steps), steps
    for step, value in zip(steps, logged_reward.batches):
        step["reward"] = value
    return {"load_s": loaded - started, "step_s": steady(clock.stamps), "steps": steps,
            "torch_threads": torch.get_num_threads()}


def worker(spec: dict) -> dict:
    load = os.getloadavg()[0]
    if spec["framework"] == "trl":
        out = trl_worker(spec["problem"])
    else:
        out = areal_flow_worker(spec["problem"], spec["eta"])
    return {**out, "loadavg_1min_before": load, "loadavg_1min_after": os.getloadavg()[0]}


# -- the benchmark ---------------------------------------------------------------------------------


def launch(spec: dict, tmp: Path) -> dict:
    out, log = tmp / f"{spec['key']}.json", tmp / f"{spec['key']}.log"
    env = {**os.environ, WORKER_ENV: json.dumps({**spec, "out": str(out)}),
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run([sys.executable, __file__], env=env, stdout=f,
                              stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        sys.stderr.write(log.read_text()[-6000:])
        raise SystemExit(f"{spec['key']} failed (exit {done.returncode}); its log is above")
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - started
    print(f"  {spec['key']}: {result['process_s']:.0f} s", file=sys.stderr)
    return result


def summarize(problem: dict, framework: str, result: dict) -> dict:
    steps = result["steps"]
    k = max(1, min(5, problem["steps"] // 3))
    rewards = [s["reward"] for s in steps]
    mean_step = sum(result["step_s"]) / len(result["step_s"])
    rows = problem["prompts"] * problem["group"]
    return {
        "model": problem["name"], "framework": framework, "s_per_step": mean_step,
        "samples_per_s": rows / mean_step,
        "completion_tokens_per_s": sum(s["completion_tokens"] for s in steps[1:])
        / sum(result["step_s"]),
        "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
        "reward_steps_averaged": k, "rewards": rewards, "step_s": result["step_s"],
        "load_s": result["load_s"], "process_s": result["process_s"], "steps": steps,
        "torch_threads": result["torch_threads"],
        "loadavg_1min": [result["loadavg_1min_before"], result["loadavg_1min_after"]],
    }


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row against the TRL row of its model: samples/s, and completion tokens/s (EOS ends
    GSM8K completions at different lengths in the two runs, so samples are not equal work)."""
    trl = {r["model"]: r for r in rows if r["framework"] == "trl"}
    for r in rows:
        base = trl[r["model"]]
        r["ratio_vs_trl"] = r["samples_per_s"] / base["samples_per_s"]
        r["token_ratio_vs_trl"] = r["completion_tokens_per_s"] / base["completion_tokens_per_s"]
    return rows


def run(quick: bool = False) -> dict:
    if importlib.util.find_spec("trl") is None:
        sys.exit(f"trl is not importable in {sys.executable}. This benchmark runs in its own venv "
                 f"(TRL stays out of the project's .venv); from the repository root:\n  {INSTALL}"
                 f"\n  OMP_NUM_THREADS=2 .venv-bench/bin/python benchmarks/trl_grpo.py --quick")
    import torch
    import transformers
    import trl

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for problem in problems(quick, tmp):
            runs = {"trl": {"framework": "trl"},
                    "areal_flow sync": {"framework": "areal_flow", "eta": 0},
                    "areal_flow async (eta=1)": {"framework": "areal_flow", "eta": 1}}
            results = {}
            for label, spec in runs.items():
                key = f"{problem['name']}-{label.split(' (')[0].replace(' ', '-')}"
                results[label] = summarize(problem, label,
                                           launch({**spec, "key": key, "problem": problem}, tmp))
            for r in results.values():
                r["config"] = {k: v for k, v in problem.items() if k != "model"}
            rows += add_ratios(list(results.values()))
    return {"benchmark": "trl_grpo", "rows": rows,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "trl": trl.__version__},
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count()}


def show(result: dict) -> None:
    v = result["versions"]
    print(f"GRPO end to end, areal_flow vs TRL {v['trl']} GRPOTrainer (torch {v['torch']}, "
          f"transformers {v['transformers']}, OMP_NUM_THREADS={result['omp_num_threads']}, "
          f"{result['cpus']} CPUs); s/step over steps 2..N\n")
    print("| model | framework | s/step | samples/s | completion tok/s | reward first→last "
          "| ratio vs TRL (samples/s) | ratio vs TRL (tok/s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        c = r["config"]
        shape = f"{r['model']} ({c['prompts']}x{c['group']}x{c['max_new_tokens']}, " \
                f"{c['steps']} steps)"
        print(f"| {shape} | {r['framework']} | {r['s_per_step']:.2f} | {r['samples_per_s']:.2f} "
              f"| {r['completion_tokens_per_s']:.1f} | {r['reward_first']:.3f}→"
              f"{r['reward_last']:.3f} | {r['ratio_vs_trl']:.2f}x | "
              f"{r['token_ratio_vs_trl']:.2f}x |")


if __name__ == "__main__":
    if WORKER_ENV in os.environ:
        spec = json.loads(os.environ[WORKER_ENV])
        Path(spec["out"]).write_text(json.dumps(worker(spec)))
    else:
        from common import main

        main(__doc__, run, show, "trl_grpo")
