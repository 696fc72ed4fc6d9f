"""The reasoning-gym recipe over several seeds: does every seed learn?

Runs `recipes/reasoning_gym_grpo.py` once per seed (its defaults, plus any recipe options after
`--`), one run after the other, and reads each run's metrics.jsonl: the greedy eval on the 200
held-out problems at step 0, every 10 steps and after the last, with its 95 % Wilson interval,
and the sampled batches' entropy and flat-group fraction. A seed *learned* when its final
accuracy is at least `GAIN` above its start and the final interval's low end is above the
start's estimate (issue 40's bar).

    python benchmarks/reasoning_gym_seeds.py [--seeds 0 1 2 3 4] [--out DIR] [-- recipe options]
    python benchmarks/reasoning_gym_seeds.py --runs RUN_DIR ...   # summarize finished runs

Writes DIR/summary.json (each seed's curve and per-step entropy, reward, flat groups, lr),
DIR/table.md and DIR/curves.png; default DIR benchmarks/results/reasoning_gym_seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import markdown_table

ROOT = Path(__file__).resolve().parents[1]
GAIN = 0.08
"""Accuracy a seed must gain from its start to its final eval."""
COLLAPSE = 0.2
"""Entropy below this share of the first step's counts as a collapse (the panel's warning)."""


def read_run(run_dir: Path) -> dict:
    """One run's eval curve and per-step numbers, from its metrics.jsonl and config.yaml."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if line.strip()]
    by_step: dict[int, dict] = {}
    for line in lines:  # an eval and a step of the same number are two lines
        by_step.setdefault(line["step"], {}).update(line)
    curve = [{"step": s, "accuracy": m["eval/accuracy"], "ci_low": m["eval/accuracy_ci_low"],
              "ci_high": m["eval/accuracy_ci_high"]}
             for s, m in sorted(by_step.items()) if "eval/accuracy" in m]
    steps = [{"step": s, "entropy": m["entropy"], "reward": m["reward/mean"],
              "flat_groups": m["reward/flat_group_fraction"], "lr": m["lr"],
              "seconds": m["seconds/step"]}
             for s, m in sorted(by_step.items()) if s > 0 and "entropy" in m]
    seed = next((int(line.split(":")[1]) for line in (run_dir / "config.yaml").read_text()
                 .splitlines() if line.startswith("seed:")), None)
    return {"seed": seed, "run_dir": str(run_dir), "curve": curve, "steps": steps}


def verdict(run: dict) -> dict:
    """Start, final, gain, whether the seed learned, and the entropy's fall."""
    start, final = run["curve"][0], run["curve"][-1]
    entropies = [s["entropy"] for s in run["steps"]]
    first = entropies[0] if entropies else float("nan")
    return {"start": start["accuracy"], "final": final["accuracy"],
            "final_ci": [final["ci_low"], final["ci_high"]],
            "best": max(c["accuracy"] for c in run["curve"]),
            "gain": final["accuracy"] - start["accuracy"],
            "learned": (final["accuracy"] - start["accuracy"] >= GAIN - 1e-9
                        and final["ci_low"] > start["accuracy"]),
            "entropy_first": first, "entropy_min": min(entropies, default=float("nan")),
            "collapsed": bool(entropies) and min(entropies) < COLLAPSE * first,
            "flat_groups_mean": statistics.mean(s["flat_groups"] for s in run["steps"])
            if run["steps"] else float("nan"),
            "minutes": sum(s["seconds"] for s in run["steps"]) / 60}


def table(runs: list[dict]) -> str:
    rows = []
    for run in runs:
        v = verdict(run)
        evals = " → ".join(f"{c['accuracy'] * 100:.1f}" for c in run["curve"])
        rows.append([run["seed"], evals, f"{v['final'] * 100:.1f} ({v['final_ci'][0] * 100:.1f}-"
                     f"{v['final_ci'][1] * 100:.1f})", f"{v['gain'] * 100:+.1f}",
                     "yes" if v["learned"] else "**no**",
                     f"{v['entropy_first']:.2f} → {v['entropy_min']:.2f}"
                     + (" (collapse)" if v["collapsed"] else ""),
                     f"{v['flat_groups_mean']:.0%}", f"{v['minutes']:.1f}"])
    gains = [verdict(r)["gain"] * 100 for r in runs]
    learned = sum(verdict(r)["learned"] for r in runs)
    return (markdown_table(["seed", "eval strict % (steps 0, 10, ...)", "final (95 % CI)",
                            "gain", f"learned (≥ +{GAIN * 100:.0f}, CI above start)",
                            "entropy first → min", "flat groups", "train min"], rows)
            + f"\n\n{learned} of {len(runs)} seeds learned; gain median "
            f"{statistics.median(gains):+.1f} points (min {min(gains):+.1f}, max "
            f"{max(gains):+.1f})")


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, ent) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        line, = acc.plot([c["step"] for c in run["curve"]],
                         [c["accuracy"] for c in run["curve"]], "o-", label=f"seed {run['seed']}")
        acc.fill_between([c["step"] for c in run["curve"]], [c["ci_low"] for c in run["curve"]],
                         [c["ci_high"] for c in run["curve"]], color=line.get_color(), alpha=0.08)
        ent.plot([s["step"] for s in run["steps"]], [s["entropy"] for s in run["steps"]],
                 color=line.get_color(), linewidth=1)
    start = statistics.mean(r["curve"][0]["accuracy"] for r in runs)
    acc.axhline(start + GAIN, color="gray", linestyle=":", linewidth=1)
    acc.annotate(f"start + {GAIN * 100:.0f} points", (0, start + GAIN), fontsize=8,
                 color="gray", xytext=(2, 2), textcoords="offset points")
    acc.set(xlabel="step", ylabel="greedy eval accuracy, strict (200 problems)", ylim=(0, 1))
    ent.set(xlabel="step", ylabel="entropy of the sampled batch (nats/token)")
    for ax in (acc, ent):
        ax.grid(alpha=0.3)
    acc.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    argv = sys.argv[1:]
    recipe_options = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--runs", type=Path, nargs="+", help="finished run folders to summarize")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/reasoning_gym_seeds")
    args = parser.parse_args(argv)
    command = [sys.executable, "recipes/reasoning_gym_grpo.py", *recipe_options]
    if args.runs:
        runs = [read_run(d) for d in args.runs]
    else:
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for seed in args.seeds:
                began = time.perf_counter()
                done = subprocess.run([*command, "--seed", str(seed), "--run-dir",
                                       f"{tmp}/s{seed}"], cwd=ROOT,
                                      env={**os.environ, "OMP_NUM_THREADS": "2"},
                                      stdout=subprocess.DEVNULL)
                if done.returncode:
                    sys.exit(f"seed {seed} failed (exit {done.returncode})")
                runs.append(read_run(Path(tmp) / f"s{seed}"))
                print(f"seed {seed}: {time.perf_counter() - began:.0f} s", file=sys.stderr)
    runs.sort(key=lambda r: r["seed"])
    args.out.mkdir(parents=True, exist_ok=True)
    shown = " ".join(["python", "recipes/reasoning_gym_grpo.py", *recipe_options])
    text = f"`{shown}`, seeds {[r['seed'] for r in runs]}\n\n{table(runs)}\n"
    print(text)
    (args.out / "table.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps(
        {"recipe": shown, "runs": [{**r, **verdict(r)} for r in runs]}, indent=1) + "\n")
    plot(runs, args.out / "curves.png", shown)


if __name__ == "__main__":
    main()
