"""Run every benchmark, one after the other, and write one report.

    python benchmarks/run.py [--quick] [--only NAME ...] [--skip-trl]

Each module runs in its own process exactly as it runs alone (`python benchmarks/NAME.py
[--quick] --out DIR/NAME.json`); its printed table goes into DIR/summary.md, under a header with
the machine and the command, and the reward curves of the end-to-end runs into DIR/rewards.png.
DIR is benchmarks/results (full) or benchmarks/results/quick (--quick: the tiny model only), or
--results DIR.
TRL runs in its own venv, .venv-bench, built here on first use (~1 min; the command is in
trl_grpo.py); --skip-trl leaves it out. OMP_NUM_THREADS defaults to the number of CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine_limits, machine_line  # noqa: E402

ROOT = HERE.parent
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
# cheapest first, so a broken environment shows up early
MODULES = ("scheduler", "engine", "decode", "kv_keep", "training", "train_step", "lora_sync",
           "async_sync", "overlap", "trl_grpo")


def bench_python() -> Path:
    """The TRL venv's interpreter, building the venv first if it is not there."""
    if not BENCH_PYTHON.exists():
        from trl_grpo import INSTALL

        print(f"building the TRL benchmark venv (once):\n  {INSTALL}", file=sys.stderr)
        subprocess.run(["bash", "-euo", "pipefail", "-c", INSTALL], cwd=ROOT, check=True)
    return BENCH_PYTHON


def run_module(name: str, python: Path | str, quick: bool, out_dir: Path) -> dict:
    command = [str(python), str(HERE / f"{name}.py"), "--out", str(out_dir / f"{name}.json")]
    command += ["--quick"] if quick else []
    print(f"== {name}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    sys.stdout.write(done.stdout)
    print(f"== {name}: {seconds:.0f} s, exit {done.returncode}\n", file=sys.stderr, flush=True)
    return {"name": name, "seconds": seconds, "exit": done.returncode, "table": done.stdout}


def plot_rewards(out_dir: Path) -> Path | None:
    """Mean batch reward by step, one panel per model: every eta, TRL beside areal_flow."""
    rows = [r for name in ("async_sync", "trl_grpo") if (out_dir / f"{name}.json").exists()
            for r in json.loads((out_dir / f"{name}.json").read_text())["rows"]
            if name == "async_sync" or r["framework"] == "trl"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows}, key=[r["model"] for r in rows].index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in rows:
            if r["model"] == model:
                ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], marker=".",
                        label=r["framework"])
        ax.set(title=model, xlabel="step", ylabel="mean batch reward")
        ax.legend()
    fig.tight_layout()
    path = out_dir / "rewards.png"
    fig.savefig(path, dpi=100)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only (minutes)")
    parser.add_argument("--only", nargs="+", choices=MODULES, default=MODULES, metavar="NAME",
                        help=f"run only these: {', '.join(MODULES)}")
    parser.add_argument("--skip-trl", action="store_true", help="leave out the TRL comparison")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="where to write (default benchmarks/results[/quick])")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    out_dir = (args.results or HERE / "results" / ("quick" if args.quick else "")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.only if not (args.skip_trl and n == "trl_grpo")]
    load = os.getloadavg()[0]
    limits = machine_limits()  # before the runs: measured on a machine as quiet as they start
    if load > 0.5:  # with 2 OpenMP threads per process, a busy core can slow a run 10x or more
        print(f"warning: load average {load:.1f} before starting; numbers from a busy machine "
              f"are not comparable", file=sys.stderr)
    started = time.perf_counter()
    runs = [run_module(n, bench_python() if n == "trl_grpo" else sys.executable, args.quick,
                       out_dir) for n in names]
    total = time.perf_counter() - started
    command = "python benchmarks/run.py " + " ".join(sys.argv[1:])
    report = [f"# Benchmarks ({'quick' if args.quick else 'full'})", "",
              f"`{command.strip()}` on {time.strftime('%Y-%m-%d')}: {machine_line()}; "
              f"1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} after "
              f"(the runs' own); {total / 60:.1f} min in all. {limits}.", ""]
    for r in runs:
        status = "" if r["exit"] == 0 else f" — FAILED (exit {r['exit']})"
        report += [f"## {r['name']} ({r['seconds']:.0f} s){status}", "", r["table"].strip(), ""]
    png = plot_rewards(out_dir)
    if png is not None:
        report += [f"Reward curves: `{png.name}` beside this file.", ""]
    (out_dir / "summary.md").write_text("\n".join(report))
    (out_dir / "run.json").write_text(json.dumps(
        {"command": command, "total_s": total,
         "modules": [{k: v for k, v in r.items() if k != "table"} for r in runs]}, indent=2))
    print(f"\nreport: {out_dir / 'summary.md'}", file=sys.stderr)
    if any(r["exit"] for r in runs):
        sys.exit(f"failed: {', '.join(r['name'] for r in runs if r['exit'])}")


if __name__ == "__main__":
    main()
