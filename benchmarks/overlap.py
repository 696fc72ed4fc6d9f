"""Where generation runs while the policy trains: in the training process (the local engine on a
thread, sharing the trainer's weights) or in a process of its own (`areal-flow serve`, weights
through a `save_pretrained` folder on /dev/shm), with the cores shared or split between them.

Each configuration runs `recipes/gsm8k_grpo.py` itself (SmolLM2-135M-Instruct, the recipe's
prompt and reward; --quick: the tiny model), a few steps, no eval or checkpoints, in its own
process; the rows compare steady s/step (steps 2..N) and the trainer process's peak RSS:
  in-process, eta 0       synchronous: generation and training take turns on all cores
  in-process, eta 1       the default: the engine generates the next batch while the trainer
                          waits; while it trains, the engine makes no step
  ..., decode while training  the engine's thread goes on generating while the trainer trains
                          (`--inference.decode-while-training`)
  ..., not hosted         the engine's thread decodes while the trainer waits too, instead of
                          the trainer's (`--inference.no-hosted`; `LocalEngine.hosted`)
  ..., engine 1 thread    the same with the engine's thread in an OpenMP pool of 1 thread
                          (`--inference.threads 1`; the trainer keeps all cores)
  own process, eta 1      `areal-flow serve`, both processes with OMP_NUM_THREADS = all cores
  own process, 1+1        the same with one OpenMP thread each (the cores split)

    python benchmarks/overlap.py [--quick] [--out benchmarks/results/overlap.json]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import main, markdown_table

ROOT = Path(__file__).resolve().parents[1]
CPUS = str(os.cpu_count())
SERVER = ["--inference.backend", "sglang", "--inference.server-program", "areal-flow"]
CONFIGS = {  # name -> (recipe options, OMP_NUM_THREADS)
    "in-process, eta 0": (["--rollout.max-staleness", "0"], CPUS),
    "in-process, eta 0, not hosted": (["--rollout.max-staleness", "0", "--inference.no-hosted"],
                                      CPUS),
    "in-process, eta 1": ([], CPUS),
    "in-process, eta 1, decode while training": (["--inference.decode-while-training"], CPUS),
    "in-process, eta 1, not hosted": (["--inference.no-hosted"], CPUS),
    "in-process, eta 0, engine 1 thread": (["--rollout.max-staleness", "0",
                                            "--inference.threads", "1"], CPUS),
    "in-process, eta 1, engine 1 thread": (["--inference.threads", "1"], CPUS),
    "in-process, eta 1, engine 1 thread, decode while training": (
        ["--inference.threads", "1", "--inference.decode-while-training"], CPUS),
    "own process, eta 1": (SERVER, CPUS),
    "own process, eta 1, 1+1 threads": (SERVER, "1"),
}


def run(quick: bool = False) -> dict:
    from areal_flow.testing.tiny_model import build_tiny_model

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm) as runs:
        shape = ["--rollout.batch-size", "2", "--rollout.group-size", "4",
                 "--sampling.max-new-tokens", "64", "--steps", "5"]
        if quick:
            shape = ["--model", str(build_tiny_model(Path(tmp) / "tiny")), "--rollout.batch-size",
                     "4", "--rollout.group-size", "4", "--sampling.max-new-tokens", "16",
                     "--steps", "10"]
        for name, (options, threads) in CONFIGS.items():
            run_dir = Path(runs) / name.replace(" ", "_").replace(",", "")
            argv = [sys.executable, "recipes/gsm8k_grpo.py", *shape, *options, "--eval-size", "0",
                    "--save-every", "1000", "--keep-checkpoints", "0", "--run-dir", str(run_dir)]
            load = os.getloadavg()[0]
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": threads})
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            # on /dev/shm the folder (its last checkpoint and weights, 2.7 GB) is memory: with
            # every earlier configuration's kept, the kernel's OOM killer ended a later run
            shutil.rmtree(run_dir)
            steps = [m for m in metrics if m.get("step", 0) > 0]
            steady = [m["seconds/step"] for m in steps[1:]]
            rows.append({
                "model": "tiny" if quick else "smollm2-135m", "config": name,
                "s_per_step": sum(steady) / len(steady), "step_s": steady,
                "train_s": sum(m["seconds/train"] for m in steps[1:]) / len(steady),
                "rollout_wait_s": sum(m["seconds/rollout_wait"] for m in steps[1:]) / len(steady),
                "sync_s": sum(m["sync/gather_seconds"] + m["sync/send_seconds"]
                              for m in steps[1:]) / len(steady),
                "peak_rss_gb": max(m["memory/peak_rss_gb"] for m in steps),
                "loadavg_1min": [load, os.getloadavg()[0]]})
    return {"benchmark": "overlap", "rows": rows, "cpus": os.cpu_count()}


def show(result: dict) -> None:
    print(f"GRPO recipe, generation in or out of the training process ({result['cpus']} CPUs); "
          "speed-up over in-process eta 0; peak RSS of the training process only\n")
    base = result["rows"][0]["s_per_step"]
    print(markdown_table(
        ["model", "generation", "s/step", "speed-up", "train s", "rollout wait s", "sync s",
         "trainer peak RSS GB"],
        [[r["model"], r["config"], f"{r['s_per_step']:.2f}", f"{base / r['s_per_step']:.2f}x",
          f"{r['train_s']:.2f}", f"{r['rollout_wait_s']:.2f}", f"{r['sync_s']:.2f}",
          f"{r['peak_rss_gb']:.2f}"] for r in result["rows"]]))


if __name__ == "__main__":
    main(__doc__, run, show, "overlap")
