"""End-to-end GRPO on this CPU: areal_flow against TRL's `GRPOTrainer`, the same problem in both.

Same model, data, prompt order, prompts per step, group size, max new tokens, temperature 1.0,
learning rate (constant, AdamW, grad-norm clip 1.0), steps; no KL; one optimizer step per batch,
with no extra forward pass for old logprobs in either; token-level loss (TRL's "dapo" = areal_flow's
"token" aggregation); group mean/std advantages. Precision: SmolLM2 runs both sides in fp32 and
both in bf16 (TRL's `bf16=True` autocast; areal_flow's bf16 engine and bf16 training with fp32
master weights), and areal_flow once more in its own default, each precision measured at start
(`runtime/precision.py`): that row compares with TRL's faster row. The tiny model runs fp32.
The problems are grpo_loop.py's: the tiny model (--quick and full; EOS never ends a completion:
areal_flow ignore_eos, TRL min_new_tokens) and SmolLM2-135M on GSM8K (full only, 6 steps: 5
timed; with 3, a step whose groups were all flat could be half of a row's timing).
areal_flow runs synchronously (max_staleness 0) and asynchronously (max_staleness 1), waiting for
its batches as the recipe does (the engine's steps on the waiting thread). Each run is
its own subprocess, one after the other. s/step is the mean wall time of steps 2..N (model loading
and the first step are left out); samples/s = completions per step / s/step; ratio = areal_flow
samples/s / TRL samples/s; reward first→last = mean batch reward of the first and last k steps;
rows trained = the fraction of the timed steps' rows areal_flow trained: the rows of a flat group
(one reward for all) have advantage 0 and skip forward and backward, where TRL runs them (its
loss on them is 0), so a low fraction makes a row's step cheaper than its completions say.
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
import sys
import tempfile
import time
from pathlib import Path

from common import main, markdown_table
from grpo_loop import (FORMAT_WEIGHT, areal_flow_worker, gsm8k_rows, launch, problem_label,
                       problems, recipe_prompt, steady, summarize, target_fraction, tiny_rows,
                       worker_spec)

INSTALL = ("python3 -m venv .venv-bench && . .venv-bench/bin/activate && "
           "pip install torch==2.13.0 && pip install -e '.[demo]' -c benchmarks/constraints.txt && "
           "pip install -r benchmarks/requirements.txt")


def trl_worker(p: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(p["seed"])
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
            output_dir=out_dir, max_steps=p["steps"], seed=p["seed"], use_cpu=True,
            per_device_train_batch_size=batch_rows, gradient_accumulation_steps=1,
            steps_per_generation=1, num_iterations=1, num_generations=p["group"],
            max_completion_length=p["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
            generation_kwargs={"min_new_tokens": p["max_new_tokens"]} if tiny else None,
            beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
            learning_rate=p["lr"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
            bf16=p.get("precision") == "bfloat16", fp16=False, gradient_checkpointing=False,
            use_vllm=False,
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
    if spec["framework"] == "trl":
        return trl_worker(spec["problem"])
    return areal_flow_worker(spec["problem"], spec["eta"])


# -- the benchmark ---------------------------------------------------------------------------------


RUNS = {  # label -> worker spec; TRL in fp32 and with its bf16 autocast (`--bf16`)
    "trl": {"framework": "trl", "precision": "float32"},
    "trl --bf16": {"framework": "trl", "precision": "bfloat16"},
    "areal_flow sync": {"framework": "areal_flow", "eta": 0, "precision": "float32"},
    "areal_flow async (eta=1)": {"framework": "areal_flow", "eta": 1, "precision": "float32"},
    "areal_flow sync, bf16": {"framework": "areal_flow", "eta": 0, "precision": "bfloat16"},
    "areal_flow async (eta=1), bf16": {"framework": "areal_flow", "eta": 1,
                                       "precision": "bfloat16"},
    # the recipe's default: each precision measured at start (runtime/precision.py)
    "areal_flow async (eta=1), own precision": {"framework": "areal_flow", "eta": 1,
                                                "precision": "auto"},
}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row against TRL's row of its precision (own precision: TRL's faster one):
    samples/s, and completion tokens/s (EOS ends GSM8K completions at different lengths in the
    two runs, so samples are not equal work)."""
    trl = {r["precision"]: r for r in rows if r["framework"].startswith("trl")}
    fastest = max(trl.values(), key=lambda r: r["samples_per_s"])
    for r in rows:
        base = trl.get(r["precision"], fastest)
        r["baseline"] = base["framework"]
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
        for problem in problems(quick, tmp, smollm2_steps=6, default_shape=True):
            runs = RUNS if problem["name"] != "tiny" else {
                label: spec for label, spec in RUNS.items() if spec["precision"] == "float32"}
            results = []
            for label, spec in runs.items():
                key = f"{problem['name']}-{label.split(' (')[0].replace(' ', '-')}-{spec['precision']}"
                case = {**problem, "precision": spec["precision"]}
                result = launch(__file__, {**spec, "key": key, "problem": case}, tmp)
                results.append({**summarize(case, label, result), "precision": spec["precision"],
                                "chosen": result.get("precision")})
            rows += add_ratios(results)
    return {"benchmark": "trl_grpo", "rows": rows,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "trl": trl.__version__},
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count()}


def show(result: dict) -> None:
    v = result["versions"]
    print(f"GRPO end to end, areal_flow vs TRL {v['trl']} GRPOTrainer (torch {v['torch']}, "
          f"transformers {v['transformers']}, OMP_NUM_THREADS={result['omp_num_threads']}, "
          f"{result['cpus']} CPUs); s/step over steps 2..N\n")
    print(markdown_table(
        ["model", "framework", "s/step", "samples/s", "completion tok/s", "reward first→last",
         "rows trained", "vs", "ratio vs TRL (samples/s)", "ratio vs TRL (tok/s)"],
        [[problem_label(r), r["framework"],
          f"{r['s_per_step']:.2f}", f"{r['samples_per_s']:.2f}",
          f"{r['completion_tokens_per_s']:.1f}",
          f"{r['reward_first']:.3f}→{r['reward_last']:.3f}",
          "all" if r.get("trained_fraction") is None else f"{r['trained_fraction']:.0%}",
          r["baseline"],
          f"{r['ratio_vs_trl']:.2f}x",
          f"{r['token_ratio_vs_trl']:.2f}x"] for r in result["rows"]]))


if __name__ == "__main__":
    if (spec := worker_spec()) is not None:
        Path(spec["out"]).write_text(json.dumps(worker(spec)))
    else:
        main(__doc__, run, show, "trl_grpo")
