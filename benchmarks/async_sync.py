"""Asynchronous vs synchronous GRPO in areal_flow: max_staleness η = 0 (on-policy, rollout waits
for training) against η = 1, 2, 4, at equal samples (same steps x prompts x completions).

Each run is grpo_loop.py's loop on one problem (tiny; SmolLM2-135M on GSM8K too in the full run,
6 steps), in its own process, one after the other. Per run: wall time of the whole loop (equal
samples, step 1 included) and its speed-up over η = 0, steady s/step (steps 2..N), completion
tokens/s, reward in the first and last k steps (equal steps), the staleness actually trained on,
and the interruption cost: tokens generated vs tokens trained, contexts re-prefilled after weight
updates, groups dropped as too stale, and weight-sync seconds per step.

    python benchmarks/async_sync.py [--quick] [--out benchmarks/results/async_sync.json]
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from common import main, markdown_table
from grpo_loop import (areal_flow_worker, launch, problem_label, problems, summarize,
                       worker_spec)

RUNS = ((0, ""), (1, ""), (1, "decode while training"), (1, "sync after the engine restarts"),
        (2, ""), (4, ""))
"""(η, variant): as the recipe, the engine makes no step while the trainer trains and syncs the
weights; "decode while training" lets it (`InferenceConfig.decode_while_training`), "sync after
the engine restarts" syncs after the engine's thread took its steps again (so the sync
interrupts the step it is in, and that step's rows are prefilled again)."""
VARIANTS = {"": {}, "decode while training": {"decode_while_training": True},
            "sync after the engine restarts": {"sync_hosted": False}}


def run(quick: bool = False) -> dict:
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for problem in problems(quick, tmp, smollm2_steps=6):
            base = None
            for eta, variant in RUNS:
                name = f"{eta}, {variant}" if variant else f"{eta}"
                result = launch(__file__, {
                    "key": f"{problem['name']}-eta{eta}-{variant.replace(' ', '-')}",
                    "eta": eta, "problem": {**problem, **VARIANTS[variant]}}, tmp)
                row = summarize(problem, f"areal_flow eta={name}", result)
                steps = result["steps"]
                row.update(
                    eta=eta, eta_label=name, wall_s=result["wall_s"],
                    generated_tokens=sum(s["generated_tokens"] for s in steps),
                    trained_tokens=sum(s["completion_tokens"] for s in steps),
                    reprefill_tokens=sum(s["reprefill_tokens"] for s in steps),
                    interruptions=sum(s["interruptions"] for s in steps),
                    dropped_stale_groups=sum(s["dropped_stale_groups"] for s in steps),
                    mean_staleness=sum(s["staleness"] for s in steps) / len(steps),
                    max_staleness=max(s["max_staleness"] for s in steps),
                    sync_s_per_step=sum(s["sync_s"] for s in steps) / len(steps))
                # what the design promises, checked on every run: the staleness limit holds
                # for every trained token, and nothing is trained that was not generated
                assert row["max_staleness"] <= eta, row["max_staleness"]
                assert row["generated_tokens"] >= row["trained_tokens"], row
                base = base or row
                row["speedup_vs_sync"] = base["wall_s"] / row["wall_s"]
                rows.append(row)
    return {"benchmark": "async_sync", "rows": rows, "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count()}


def show(result: dict) -> None:
    print(f"areal_flow GRPO, synchronous (eta 0) vs asynchronous at equal samples "
          f"({result['cpus']} CPUs, OMP_NUM_THREADS={result['omp_num_threads']})\n")
    print(markdown_table(
        ["model", "eta", "wall s", "speed-up vs eta 0", "s/step", "completion tok/s",
         "reward first→last", "staleness mean/max"],
        [[problem_label(r), r.get("eta_label", r["eta"]),
          f"{r['wall_s']:.1f}", f"{r['speedup_vs_sync']:.2f}x", f"{r['s_per_step']:.3f}",
          f"{r['completion_tokens_per_s']:.0f}",
          f"{r['reward_first']:.3f}→{r['reward_last']:.3f}",
          f"{r['mean_staleness']:.2f}/{r['max_staleness']}"] for r in result["rows"]]))
    print("\nInterruption cost over the same runs (tokens generated but not trained are those "
          "still in flight when the loop stops, plus any dropped group's)\n")
    print(markdown_table(
        ["model", "eta", "generated tokens", "trained tokens", "not trained", "dropped groups",
         "interrupted requests", "re-prefilled tokens", "weight sync s/step"],
        [[r["model"], r.get("eta_label", r["eta"]), r["generated_tokens"], r["trained_tokens"],
          r["generated_tokens"] - r["trained_tokens"], r["dropped_stale_groups"],
          r["interruptions"], r["reprefill_tokens"], f"{r['sync_s_per_step']:.3f}"]
         for r in result["rows"]]))


if __name__ == "__main__":
    if (spec := worker_spec()) is not None:
        Path(spec["out"]).write_text(json.dumps(areal_flow_worker(spec["problem"], spec["eta"])))
    else:
        main(__doc__, run, show, "async_sync")
