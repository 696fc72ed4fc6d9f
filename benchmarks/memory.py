"""Where the default GSM8K run's memory goes: resident memory around each station, and what a
training step saves for backward.

    python benchmarks/memory.py stations [--steps 8] [recipe options]
        recipes/gsm8k_grpo.py in this process (eval off), resident memory sampled every 10 ms:
        before, peak during and after each of the trainer's stations, a line per call
    python benchmarks/memory.py saved [--checkpointing] [--budget B]
        one `TrainEngine.train` of `train_step.py`'s batch on the SmolLM2-135M shape with the RL
        recipes' training settings (B: another `compiled_layers.ACTIVATION_BUDGET`): the tensors
        autograd saves for backward, by last dimension and dtype (each storage once)
"""

from __future__ import annotations

import collections
import runpy
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "recipes")]
STATIONS = ("role_forwards", "advantages", "update", "sync_weights")


def rss_gb() -> float:
    from areal_flow.process_memory import rss_bytes

    return rss_bytes() / 2**30


def stations(steps: int, options: list[str]) -> None:
    from areal_flow.runtime import engine

    peak = [0.0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss_gb())
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()

    def watched(name: str):
        method = getattr(engine.TrainEngine, name)

        def call(self, *args, **kwargs):
            before, between = rss_gb(), peak[0]
            peak[0] = before  # a call shorter than the sampling interval peaks at its start
            out = method(self, *args, **kwargs)
            print(f"| {name} | {between:.2f} | {before:.2f} | {peak[0]:.2f} | {rss_gb():.2f} |",
                  flush=True)
            peak[0] = 0.0
            return out
        return call

    for name in STATIONS:
        setattr(engine.TrainEngine, name, watched(name))
    print("| station | peak since the last station GB | before GB | peak during GB | after GB |\n"
          "|---|---|---|---|---|")
    # the recipe ends the process (`exit_process`): its folder is cleared before, not after
    run_dir = Path(tempfile.gettempdir()) / "areal_flow_memory_stations"
    shutil.rmtree(run_dir, ignore_errors=True)
    sys.argv = ["gsm8k_grpo.py", "--steps", str(steps), "--eval-size", "0", "--run-dir",
                str(run_dir), *options]
    runpy.run_path(str(ROOT / "recipes" / "gsm8k_grpo.py"), run_name="__main__")


def saved(checkpointing: bool, budget: float | None = None) -> None:
    import torch

    if budget is not None:  # the min-cut partitioner's share of activations to keep
        from areal_flow.runtime import compiled_layers

        compiled_layers.ACTIVATION_BUDGET = budget

    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import OptimizerConfig, PolicyLossConfig
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from benchmarks.engine import smollm2_sized
    from train_step import batch

    with tempfile.TemporaryDirectory() as tmp:
        trainer = TrainEngine(smollm2_sized(Path(tmp) / "smol"), TrainConfig(
            optim=OptimizerConfig(lr=1e-6), dtype="auto", max_tokens_per_mb=4096,
            packed_attention=True, compile="on", activation_checkpointing=checkpointing))
    algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False)))
    data = batch(trainer.model.config.vocab_size)
    trainer.train(data, algorithm)  # compiles
    storages: dict[int, int] = {}
    kinds: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()

    def pack(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            kind = (t.shape[-1] if t.dim() else 0, str(t.dtype).removeprefix("torch."))
            kinds[kind] += t.untyped_storage().nbytes()
            counts[kind] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = trainer.train(data, algorithm)
    total = sum(storages.values())
    print(f"{int(stats['train/micro_batches'])} micro-batches, {int(data['attention_mask'].sum())}"
          f" tokens ({int(stats['train/tokens'])} trained), activation checkpointing "
          f"{checkpointing}: {total / 2**30:.2f} GB saved for backward over the step\n")
    print("| last dimension | dtype | tensors | MB |\n|---|---|---|---|")
    for (dim, dtype), size in kinds.most_common(8):
        print(f"| {dim} | {dtype} | {counts[dim, dtype]} | {size / 2**20:.0f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["stations"]:
        args = sys.argv[2:]
        steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 8
        if "--steps" in args:
            del args[args.index("--steps"):args.index("--steps") + 2]
        stations(steps, args)
    elif sys.argv[1:2] == ["saved"]:
        saved("--checkpointing" in sys.argv, float(sys.argv[sys.argv.index("--budget") + 1])
              if "--budget" in sys.argv else None)
    else:
        sys.exit(__doc__)
