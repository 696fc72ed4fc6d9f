"""Where the default GSM8K run's memory goes: resident memory around each station, and what a
training step saves for backward.

    python benchmarks/memory.py stations [--steps 8] [recipe options]
        recipes/gsm8k_grpo.py in this process (eval off), resident memory sampled every 10 ms:
        before, peak during and after each of the trainer's stations, a line per call
    python benchmarks/memory.py saved [--checkpointing] [--budget B]
        one `TrainEngine.train` of `train_step.py`'s batch on the SmolLM2-135M shape with the RL
        recipes' training settings (B: another `compiled_layers.ACTIVATION_BUDGET`): the tensors
        autograd saves for backward, by last dimension and dtype (each storage once)
    python benchmarks/memory.py lengths [--steps 8]
        `TrainEngine.train` on the SmolLM2-135M shape, the RL recipes' training settings, each
        step's rows 7 tokens longer than the last (as a run's lengths vary): glibc's heap in use
        and resident memory after each step, and s/step, with training attention padded to a
        few lengths (`packed_attention.py`) and without (each its own process)
"""

from __future__ import annotations

import collections
import ctypes
import json
import runpy
import shutil
import subprocess
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


def heap_in_use_gb() -> float:
    """Bytes glibc's malloc has handed out and not had back, over all arenas (`mallinfo2`)."""
    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = Mallinfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**30  # small blocks in use + mmapped ones


def lengths_one(steps: int, padded: bool) -> dict:
    """One configuration, in this process: a JSON line of heap and RSS per step, and s/step."""
    import torch

    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import OptimizerConfig, PolicyLossConfig
    from areal_flow.runtime import packed_attention
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from benchmarks.engine import smollm2_sized
    from train_step import batch

    if not padded:
        packed_attention.KERNEL_CACHING_DEVICES = set()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TrainEngine(smollm2_sized(Path(tmp) / "smol"), TrainConfig(
            optim=OptimizerConfig(lr=1e-6), dtype="auto", max_tokens_per_mb=4096,
            packed_attention=True, compile="auto"))
    algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False)))
    heap, rss, seconds = [], [], []
    for step in range(steps):
        data = batch(trainer.model.config.vocab_size, prompt_len=100 + 7 * step, new_tokens=64)
        data["rewards"][:8] = torch.rand(8, generator=torch.Generator().manual_seed(step))
        start = time.perf_counter()
        trainer.train(data, algorithm)
        seconds.append(time.perf_counter() - start)
        heap.append(heap_in_use_gb())
        rss.append(rss_gb())
    return {"padded": padded, "dtype": trainer.precision.dtype, "heap_gb": heap, "rss_gb": rss,
            "s_per_step": sorted(seconds[1:])[len(seconds[1:]) // 2]}  # median, compile apart


def lengths(steps: int) -> None:
    rows = []
    for padded in ("padded", "as they come"):
        out = subprocess.run([sys.executable, __file__, "lengths-one", str(steps), padded],
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{steps} steps, rows 7 tokens longer each step; training precision {rows[0]['dtype']}"
          "\n\n| attention lengths | heap in use after step 1 → last GB | growth a step MB "
          "| RSS after step 1 → last GB | s/step (median) |\n|---|---|---|---|---|")
    for row in rows:
        growth = (row["heap_gb"][-1] - row["heap_gb"][0]) / (steps - 1) * 1024
        name = "padded to a few" if row["padded"] else "as they come"
        print(f"| {name} | {row['heap_gb'][0]:.2f} → {row['heap_gb'][-1]:.2f} | {growth:.0f} "
              f"| {row['rss_gb'][0]:.2f} → {row['rss_gb'][-1]:.2f} | {row['s_per_step']:.2f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["stations"]:
        args = sys.argv[2:]
        steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 8
        if "--steps" in args:
            del args[args.index("--steps"):args.index("--steps") + 2]
        stations(steps, args)
    elif sys.argv[1:2] == ["lengths"]:
        lengths(int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 8)
    elif sys.argv[1:2] == ["lengths-one"]:
        print(json.dumps(lengths_one(int(sys.argv[2]), sys.argv[3] == "padded")))
    elif sys.argv[1:2] == ["saved"]:
        saved("--checkpointing" in sys.argv, float(sys.argv[sys.argv.index("--budget") + 1])
              if "--budget" in sys.argv else None)
    else:
        sys.exit(__doc__)
