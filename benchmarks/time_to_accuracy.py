"""Time to accuracy on a reasoning-gym task: areal_flow's recipe against TRL's `GRPOTrainer`.

SmolLM2-135M-Instruct (the packaged one) is trained with GRPO twice on one reasoning-gym task
(default the recipe's: one-digit +, -, * expressions of 2-3 terms): once by recipes/reasoning_gym_grpo.py, once by TRL's
GRPOTrainer. Both get the same training rows and 200 held-out eval rows
(areal_flow.data.reasoning_gym.train_eval_rows), the same user message (--prompt-template through
the model's chat template, whose default system prompt SmolLM2 adds in both), the same reward
(areal_flow.reward.reasoning_gym), P prompts x G completions x T max new tokens per step, the
learning rate and its schedule (constant or linear decay to 0; AdamW, no warmup or weight decay,
grad-norm clip 1.0), steps and seed;
temperature 1.0, no KL, one optimizer step per batch (num_iterations 1), token-level loss (TRL's
"dapo" = areal_flow's "token" aggregation), group mean/std advantages, eps clip 0.2, fp32 weights
for generation and training, EOS ends a completion. The eval protocol is the same: greedy decoding
of at most T tokens on the 200 eval rows before training (step 0), every k steps and after the
last step, graded strictly (areal_flow.reward.reasoning_gym.grade "accuracy"), with the 95% Wilson
interval. areal_flow evaluates through its recipe; TRL through a callback here that generates the
same chat-templated prompt ids, batched with left padding, model in eval mode, no gradients.

Training seconds exclude eval time on both sides: areal_flow's at step s is the sum of the
recipe's `seconds/step` over steps 1..s (each measured before that step's eval runs); TRL's is
the wall time since `on_train_begin` less the time spent in the eval callback. Model loading is
in neither. Each seed runs both sides, one after the other. Thresholds: start = areal_flow's
step-0 accuracy (the same model, greedy, on every seed; TRL's own step 0 is in the curves), TRL's
mean gain = the mean of TRL's final accuracies over the seeds - start, and threshold_q = start +
q x that gain for q = 0.5, 0.7. A run's time to a threshold is the training seconds at its first
eval whose accuracy is at least that (never, if none is); each side reports every seed's time and
their median (a run that never got there counts as later than all), and the ratio is TRL's median
/ areal_flow's (> 1: areal_flow gets there sooner). With TRL's mean final <= start no threshold
is defined. A time is only known to an eval interval: keep k small.

Differences left:
- areal_flow runs its recipe's default, asynchronous (max_staleness 1): its rollouts keep running
  while it evaluates (step 0's eval included), so the step after an eval may find its batch
  already generated. This favours areal_flow slightly; `eval_overlap_gain_s` estimates by how
  much (the shortfall of the post-eval steps' rollout wait against the median of the others).
  TRL is on-policy and synchronous; areal_flow weights its one-version-stale tokens by the
  decoupled-PPO behaviour ratio (capped at 5).
- Order: areal_flow admits prompts in its scheduler's seeded permutation of the training rows
  (`random.Random(seed * 1_000_003 + epoch)`); TRL gets the rows in that order (not shuffled
  again), but areal_flow's batches take groups in the order they finish, so a batch can hold
  other prompts than TRL's batch of the same step.
- TRL divides by the group's sample std (Bessel) + 1e-4, areal_flow by the population std + 1e-6;
  the two sample with different random streams.
- Greedy eval is areal_flow's engine against `model.generate`: the same ids and argmax, but
  differently batched fp32 arithmetic can break a near-tie differently.

Install, in the venv of benchmarks/trl_grpo.py plus reasoning-gym (TRL stays out of .venv):
    python3 -m venv .venv-bench && . .venv-bench/bin/activate
    pip install torch==2.13.0                  # the CPU build where pip finds one
    pip install -e '.[demo,reasoning-gym]' -c benchmarks/constraints.txt
    pip install -r benchmarks/requirements.txt # trl==1.16.0, torch/transformers pinned

    OMP_NUM_THREADS=2 .venv-bench/bin/python benchmarks/time_to_accuracy.py [--quick]
        [--task SPEC] [--steps N] [--eval-every K] [--prompts P] [--group G]
        [--max-new-tokens T] [--lr LR] [--schedule constant|linear] [--seeds S ...]
        [--out FILE]
    (default benchmarks/results/time_to_accuracy.json, and .png beside it)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from common import markdown_table
from grpo_loop import ROOT, WORKER_ENV, worker_spec

NAME = "time_to_accuracy"
INSTALL = ("python3 -m venv .venv-bench && . .venv-bench/bin/activate && "
           "pip install torch==2.13.0 && "
           "pip install -e '.[demo,reasoning-gym]' -c benchmarks/constraints.txt && "
           "pip install -r benchmarks/requirements.txt")
# recipes/reasoning_gym_grpo.py's defaults
TASK = ("reasoning_gym:basic_arithmetic?min_terms=2&max_terms=3&max_digits=1"
        "&operators=['+','-','*']&allow_parentheses=false&allow_negation=false&size=200")
PROMPT = "{question} Reply with only the final answer."
FRACTIONS = (0.5, 0.7)
FULL = {"steps": 50, "eval_every": 10, "eval_size": 200, "prompts": 4, "group": 8,
        "max_new_tokens": 24, "lr": 2e-5, "schedule": "constant"}
QUICK = {**FULL, "steps": 3, "eval_every": 1, "eval_size": 8, "prompts": 2, "group": 4}
SEEDS = (0, 1, 2)
EVAL_BATCH = 64  # the local engine's default max_batch_size


# -- time to threshold (pure) ----------------------------------------------------------------------


def thresholds(start: float, final: float,
               fractions: Sequence[float] = FRACTIONS) -> dict[float, float] | None:
    """start + q (final - start) for each q; None when final <= start (nothing was learned)."""
    if final <= start:
        return None
    return {q: start + q * (final - start) for q in fractions}


def time_to_threshold(points: Sequence[tuple[float, float]], threshold: float) -> float | None:
    """The seconds of the first (seconds, accuracy) point whose accuracy reaches `threshold`, or
    None. Accuracies are counts / n, so a threshold computed to be one of them (e.g. halfway
    between 0.1 and 0.3) is reached despite float rounding."""
    return next((s for s, accuracy in points if accuracy >= threshold - 1e-9), None)


# -- the areal_flow side: the recipe as it is run --------------------------------------------------


def recipe_command(p: dict, run_dir: Path) -> list[str]:
    """recipes/reasoning_gym_grpo.py with the shared settings spelled out (most are defaults)."""
    workflow = {"reward": "reasoning_gym", "prompt_template": p["prompt_template"]}
    return [
        sys.executable, str(ROOT / "recipes" / "reasoning_gym_grpo.py"),
        "--model", p["model"], "--dataset", p["task"], "--run-dir", str(run_dir),
        "--workflow-config", json.dumps(workflow), "--seed", str(p["seed"]),
        "--steps", str(p["steps"]), "--eval-size", str(p["eval_size"]),
        "--eval-every", str(p["eval_every"]), "--save-every", str(p["steps"]),
        "--rollout.batch-size", str(p["prompts"]), "--rollout.group-size", str(p["group"]),
        "--rollout.max-staleness", "1",
        "--rollout.max-concurrent", str(2 * p["prompts"] * p["group"]),
        "--rollout.filter-flat-groups", "0",  # TRL's GRPOTrainer has no dynamic sampling
        "--algorithm.entropy-target", "None",  # nor entropy control
        "--sampling.max-new-tokens", str(p["max_new_tokens"]), "--sampling.temperature", "1.0",
        "--train.optim.lr", str(p["lr"]), "--train.optim.schedule", p["schedule"],
        "--train.optim.warmup-steps", "0",
        "--train.optim.weight-decay", "0", "--train.optim.max-grad-norm", "1.0",
        "--train.dtype", "float32", "--inference.dtype", "float32", "--algorithm.kl-coef", "0",
        "--algorithm.loss.aggregation", "token", "--algorithm.loss.eps-clip", "0.2"]


def areal_flow_curve(metrics_file: Path) -> dict:
    """Eval points and per-step numbers from the recipe's metrics.jsonl."""
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    by_step = {line["step"]: line for line in lines}  # a step logged twice: the last line
    seconds, curve, steps = 0.0, [], []
    for step in sorted(by_step):
        line = by_step[step]
        if step > 0:
            seconds += line["seconds/step"]
            steps.append({"step": step, "seconds": line["seconds/step"],
                          "rollout_wait_s": line["seconds/rollout_wait"],
                          "train_s": line["seconds/train"], "reward": line["reward/mean"]})
        if "eval/accuracy" in line:
            curve.append({"step": step, "train_s": seconds, "accuracy": line["eval/accuracy"],
                          "ci_low": line["eval/accuracy_ci_low"],
                          "ci_high": line["eval/accuracy_ci_high"],
                          "accuracy_lenient": line.get("eval/accuracy_lenient")})
    return {"curve": curve, "steps": steps, "eval_overlap_gain_s": overlap_gain(curve, steps)}


def overlap_gain(curve: list[dict], steps: list[dict]) -> float | None:
    """Rollout wait the steps right after an eval were spared, against the median wait of the
    others: an estimate of the head start areal_flow's rollouts get while it evaluates."""
    after_eval = {point["step"] + 1 for point in curve}
    others = [s["rollout_wait_s"] for s in steps if s["step"] not in after_eval]
    if not others:
        return None
    typical = statistics.median(others)
    return sum(max(0.0, typical - s["rollout_wait_s"]) for s in steps if s["step"] in after_eval)


# -- the TRL side ----------------------------------------------------------------------------------


def areal_flow_order(n_rows: int, needed: int, seed: int) -> list[int]:
    """Row indices in the order areal_flow's RolloutScheduler admits them (shuffle=True, its
    seed): a fresh permutation per epoch, as many epochs as `needed` rows take."""
    order: list[int] = []
    for epoch in range(math.ceil(needed / n_rows)):
        permutation = list(range(n_rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(permutation)
        order += permutation
    return order[:needed]


def trl_worker(p: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, GenerationConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_flow.data.reasoning_gym import train_eval_rows
    from areal_flow.rl_recipes import wilson_interval
    from areal_flow.reward.reasoning_gym import grade, reasoning_gym

    torch.manual_seed(p["seed"])
    started = time.perf_counter()
    train_rows, eval_rows, _ = train_eval_rows(p["task"], p["eval_size"])
    tokenizer = AutoTokenizer.from_pretrained(p["model"])

    def message(row: dict) -> list[dict]:
        return [{"role": "user", "content": p["prompt_template"].format(question=row["question"])}]

    order = areal_flow_order(len(train_rows), p["steps"] * p["prompts"], p["seed"])
    # the entry goes as JSON: Arrow would force one schema on every row's metadata
    dataset = Dataset.from_list([{"prompt": message(train_rows[i]),
                                  "entry": json.dumps(train_rows[i]["answer"])} for i in order])

    def reward(completions, entry, **kwargs):
        return [reasoning_gym(c[0]["content"], answer=json.loads(e))
                for c, e in zip(completions, entry)]

    # eval prompts: the ids areal_flow's rlvr workflow sends (chat template, generation prompt)
    def chat_ids(row: dict) -> list[int]:
        ids = tokenizer.apply_chat_template(message(row), add_generation_prompt=True)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]

    eval_ids = [chat_ids(row) for row in eval_rows]
    greedy = GenerationConfig(max_new_tokens=p["max_new_tokens"], do_sample=False,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, use_cache=True)

    def accuracy(model) -> dict:
        was_training = model.training
        model.eval()
        texts = []
        with torch.no_grad():
            for i in range(0, len(eval_ids), EVAL_BATCH):
                chunk = eval_ids[i:i + EVAL_BATCH]
                width = max(map(len, chunk))
                input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(ids)) + ids
                                          for ids in chunk])
                mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk])
                out = model.generate(input_ids=input_ids, attention_mask=mask,
                                     generation_config=greedy)
                texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        model.train(was_training)
        grades = [grade(text, row["answer"]) for text, row in zip(texts, eval_rows)]
        correct = sum(g["accuracy"] for g in grades)
        low, high = wilson_interval(round(correct), len(grades))
        return {"accuracy": correct / len(grades), "ci_low": low, "ci_high": high,
                "accuracy_lenient": sum(g["accuracy_lenient"] for g in grades) / len(grades)}

    class Evaluator(TrainerCallback):
        """Evaluates at step 0, every `eval_every` steps and after the last; keeps its own time
        out of the training seconds."""

        def __init__(self):
            self.curve: list[dict] = []
            self.began = self.eval_s = 0.0

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.began = time.perf_counter()
            self.evaluate(model, 0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            if step % p["eval_every"] == 0 or step == state.max_steps:
                self.evaluate(model, step)

        def evaluate(self, model, step: int) -> None:
            began = time.perf_counter()
            train_s = began - self.began - self.eval_s
            point = accuracy(model)
            self.eval_s += time.perf_counter() - began
            self.curve.append({"step": step, "train_s": train_s, **point})

    rows = p["prompts"] * p["group"]
    evaluator = Evaluator()
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, max_steps=p["steps"], seed=p["seed"], use_cpu=True,
            per_device_train_batch_size=rows, generation_batch_size=rows,
            gradient_accumulation_steps=1, num_iterations=1, num_generations=p["group"],
            max_completion_length=p["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
            learning_rate=p["lr"], lr_scheduler_type=p["schedule"], warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
            bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False,
            shuffle_dataset=False, report_to=[], logging_steps=1, save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=p["model"], reward_funcs=reward, args=config,
                              train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[evaluator])
        loaded = time.perf_counter()
        trainer.train()
        finished = time.perf_counter()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert trainer.state.global_step == p["steps"], trainer.state.global_step
    assert [c["step"] for c in evaluator.curve] == eval_steps(p), evaluator.curve
    return {"curve": evaluator.curve, "rewards": rewards, "load_s": loaded - started,
            "train_wall_s": finished - evaluator.began, "eval_s": evaluator.eval_s,
            "torch_threads": torch.get_num_threads()}


# -- the benchmark ---------------------------------------------------------------------------------


def eval_steps(p: dict) -> list[int]:
    """The steps both sides evaluate after: 0, every eval_every, and the last."""
    return sorted({0, p["steps"], *range(p["eval_every"], p["steps"] + 1, p["eval_every"])})


def subprocess_run(label: str, command: list[str], env: dict, log: Path) -> dict:
    """Run one side in its own process; its wall time and the load average around it."""
    load_before = os.getloadavg()
    started = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(command, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env},
                              stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        sys.stderr.write(log.read_text()[-6000:])
        raise SystemExit(f"{label} failed (exit {done.returncode}); its log is above")
    process_s = time.perf_counter() - started
    print(f"  {label}: {process_s:.0f} s", file=sys.stderr)
    return {"process_s": process_s, "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg())}


def median_time(times: Sequence[float | None]) -> float:
    """The median of the runs' times, a run that never got there counting as later than all
    (inf where half or more never did)."""
    return statistics.median(math.inf if t is None else t for t in times)


def compare(runs: list[dict]) -> dict:
    """Thresholds at `FRACTIONS` of TRL's mean gain over the start (areal_flow's step-0
    accuracy: greedy decoding of the same model, the same on every seed), each run's time to
    them, and the ratio of the two sides' median times."""
    start = statistics.mean(r["areal_flow"]["curve"][0]["accuracy"] for r in runs)
    trl_final = statistics.mean(r["trl"]["curve"][-1]["accuracy"] for r in runs)
    out: dict = {"start_accuracy": start, "trl_mean_final_accuracy": trl_final,
                 "areal_flow_mean_final_accuracy": statistics.mean(
                     r["areal_flow"]["curve"][-1]["accuracy"] for r in runs)}
    levels = thresholds(start, trl_final)
    if levels is None:
        out.update(thresholds=None, note=f"TRL's mean final accuracy {trl_final:.3f} is not "
                   f"above the start {start:.3f}: no threshold is defined")
        return out
    rows = []
    for q, level in levels.items():
        row: dict = {"fraction": q, "accuracy": level}
        for side in ("areal_flow", "trl"):
            times = [time_to_threshold([(c["train_s"], c["accuracy"]) for c in r[side]["curve"]],
                                       level) for r in runs]
            row[f"{side}_s"] = times
            row[f"{side}_median_s"] = median_time(times)
        ours, theirs = row["areal_flow_median_s"], row["trl_median_s"]
        row["ratio_of_medians"] = theirs / ours if math.isfinite(theirs) and ours else None
        if not math.isfinite(theirs) and math.isfinite(ours):  # TRL's median run never got
            # there: it needs more than all its training
            row["ratio_lower_bound"] = statistics.median(
                r["trl"]["curve"][-1]["train_s"] for r in runs) / ours
        rows.append(row)
    out["thresholds"] = rows
    return out


def run(p: dict, seeds: Sequence[int]) -> dict:
    missing = [m for m in ("trl", "reasoning_gym") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"{', '.join(missing)} not importable in {sys.executable}. This benchmark runs in "
                 f"its own venv (TRL stays out of the project's .venv); from the repository root:"
                 f"\n  {INSTALL}\n  OMP_NUM_THREADS=2 .venv-bench/bin/python "
                 f"benchmarks/time_to_accuracy.py --quick")
    import torch
    import transformers
    import trl

    from areal_flow.data.packaged import packaged_smollm2

    p = {**p, "model": str(packaged_smollm2())}
    runs = []
    for seed in seeds:  # the two sides of a seed one after the other, then the next seed
        q = {**p, "seed": seed}
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            ours = subprocess_run(f"areal_flow seed {seed}", recipe_command(q, tmp / "areal_flow"),
                                  {}, tmp / "areal_flow.log")
            ours.update(areal_flow_curve(tmp / "areal_flow" / "metrics.jsonl"))
            out = tmp / "trl.json"
            theirs = subprocess_run(f"trl seed {seed}", [sys.executable, __file__],
                                    {WORKER_ENV: json.dumps({**q, "out": str(out)})},
                                    tmp / "trl.log")
            theirs.update(json.loads(out.read_text()))
        for side in (ours, theirs):
            assert [c["step"] for c in side["curve"]] == eval_steps(p), side["curve"]
        runs.append({"seed": seed, "areal_flow": ours, "trl": theirs})
    return {"benchmark": NAME, "config": p, "seeds": list(seeds), **compare(runs), "runs": runs,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "trl": trl.__version__},
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count()}


def show(result: dict) -> None:
    c, v = result["config"], result["versions"]
    print(f"Time to accuracy, areal_flow recipe vs TRL {v['trl']} GRPOTrainer on "
          f"{c['task'].removeprefix('reasoning_gym:')}: {c['prompts']}x{c['group']}x"
          f"{c['max_new_tokens']}, lr {c['lr']} ({c['schedule']}), {c['steps']} steps, seeds "
          f"{result['seeds']}, greedy eval on {c['eval_size']} problems every {c['eval_every']} "
          f"(torch {v['torch']}, transformers {v['transformers']}, OMP_NUM_THREADS="
          f"{result['omp_num_threads']}, {result['cpus']} CPUs); seconds = training seconds, "
          f"evals excluded\n")
    runs = result["runs"]
    header = ["step"] + [f"{side} s{r['seed']}" for side in ("areal_flow", "TRL") for r in runs]
    table = []
    for i, point in enumerate(runs[0]["areal_flow"]["curve"]):
        cells = [point["step"]]
        for side in ("areal_flow", "trl"):
            cells += [f"{r[side]['curve'][i]['accuracy']:.3f} @ {r[side]['curve'][i]['train_s']:.0f} s"
                      for r in runs]
        table.append(cells)
    print(markdown_table(header, table))
    print()
    if result["thresholds"] is None:
        print(result["note"])
    else:
        def seconds(times):
            return ", ".join("never" if t is None else f"{t:.0f}" for t in times)

        def median(x):
            return "never" if not math.isfinite(x) else f"{x:.0f}"

        def ratio(row):
            if row["ratio_of_medians"] is not None:
                return f"{row['ratio_of_medians']:.2f}x"
            return f"> {row['ratio_lower_bound']:.2f}x" if "ratio_lower_bound" in row else "—"

        print(f"start {result['start_accuracy']:.3f}; mean final: TRL "
              f"{result['trl_mean_final_accuracy']:.3f}, areal_flow "
              f"{result['areal_flow_mean_final_accuracy']:.3f}\n")
        print(markdown_table(
            ["of TRL's mean gain", "accuracy", "areal_flow s (each seed)", "median",
             "TRL s (each seed)", "median", "TRL / areal_flow (medians)"],
            [[f"{r['fraction']:.0%}", f"{r['accuracy']:.3f}", seconds(r["areal_flow_s"]),
              median(r["areal_flow_median_s"]), seconds(r["trl_s"]), median(r["trl_median_s"]),
              ratio(r)] for r in result["thresholds"]]))
    gains = [r["areal_flow"]["eval_overlap_gain_s"] for r in runs]
    load = [r[s]["loadavg_before"][0] for r in runs for s in ("areal_flow", "trl")]
    print("\nareal_flow's rollouts during evals: rollout wait spared "
          + ", ".join("—" if g is None else f"~{g:.0f} s" for g in gains)
          + f"; 1-min load before each run: {min(load):.2f}-{max(load):.2f}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    trl = f"TRL {result['versions']['trl']} GRPOTrainer"
    for side, label, color in (("areal_flow", "areal_flow (recipe, η=1)", "tab:blue"),
                               ("trl", trl, "tab:orange")):
        for i, run in enumerate(result["runs"]):
            curve = run[side]["curve"]
            ax.plot([c["train_s"] for c in curve], [c["accuracy"] for c in curve], "o-",
                    color=color, alpha=0.7, markersize=3,
                    label=f"{label}, seeds {result['seeds']}" if i == 0 else None)
    for row in result["thresholds"] or []:
        ax.axhline(row["accuracy"], color="gray", linestyle=":", linewidth=1)
        ax.annotate(f"{row['fraction']:.0%} of TRL's mean gain", (0, row["accuracy"]),
                    fontsize=8, color="gray", xytext=(2, 2), textcoords="offset points")
    c = result["config"]
    ax.set_xlabel("training seconds (eval excluded)")
    ax.set_ylabel(f"greedy eval accuracy, strict ({c['eval_size']} problems)")
    ax.set_title(f"SmolLM2-135M GRPO on {c['task'].removeprefix('reasoning_gym:').split('?')[0]}"
                 f": {c['prompts']}x{c['group']}x{c['max_new_tokens']}, lr {c['lr']} "
                 f"({c['schedule']}), {c['steps']} steps", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cli() -> None:
    """common.main's command line (run, print the table, write the JSON) with this benchmark's
    settings, and the plot beside the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    smoke = ", ".join(f"{k} {v}" for k, v in QUICK.items() if FULL[k] != v)
    parser.add_argument("--quick", action="store_true", help=f"a smoke configuration: {smoke}")
    parser.add_argument("--out", default=f"benchmarks/results/{NAME}.json",
                        help="the JSON; the PNG goes beside it")
    parser.add_argument("--task", default=TASK, help="a 'reasoning_gym:<task>?key=value&...' spec")
    parser.add_argument("--prompt-template", default=PROMPT)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"default {' '.join(map(str, SEEDS))} (0 with --quick)")
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                            help=f"default {value} ({QUICK[key]} with --quick)")
    args = parser.parse_args()
    p = {key: getattr(args, key) if getattr(args, key) is not None else default
         for key, default in (QUICK if args.quick else FULL).items()}
    p.update(task=args.task, prompt_template=args.prompt_template)
    result = run(p, args.seeds or ([0] if args.quick else SEEDS))
    show(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    if (spec := worker_spec()) is not None:
        Path(spec["out"]).write_text(json.dumps(trl_worker(spec)))
    else:
        cli()
