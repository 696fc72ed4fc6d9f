"""Weight sync per step, LoRA against full fine-tuning: bytes and seconds from the trainer to the
generation pool, on SmolLM2-135M (--quick: the tiny model).

    python benchmarks/lora_sync.py [--quick]

Each row syncs the same trainer (after one optimizer step) the way a recipe does, several times,
and reports the median:

- ``in memory``: a bf16 local engine in the trainer's process (it cannot keep the fp32 trainer's
  tensors, so every sync copies them: all of them, or the adapter's);
- ``folder``: what an SGLang(-protocol) server gets: a `save_pretrained` folder loaded with
  ``/update_weights_from_disk``, or a PEFT adapter folder loaded with ``/load_lora_adapter``;
  here the folder is written and loaded into a local engine, as `areal-flow serve` does;
- ``live``: an fp32 engine that keeps the trainer's own tensors (the CPU default): nothing moves
  either way.

The seconds include writing and reading the folder; over a network add bytes / bandwidth.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the fixed batch
from common import main, markdown_table  # noqa: E402

REPEATS = 5


def run(quick: bool) -> dict:
    import torch

    from areal_flow.config import OptimizerConfig
    from areal_flow.inference.local import LocalEngine
    from areal_flow.lora import LoraConfig
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from tests.dist_train_script import TokenNLL, fixed_batch

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        if quick:
            from areal_flow.testing.tiny_model import build_tiny_model

            model, name = build_tiny_model(Path(tmp) / "tiny"), "tiny"
        else:
            from areal_flow.data.packaged import packaged_smollm2

            model, name = packaged_smollm2(), "SmolLM2-135M"
        rows = []
        for label, lora in (("full", LoraConfig()), ("LoRA r=16 all-linear",
                                                     LoraConfig(rank=16, alpha=32))):
            trainer = TrainEngine(model, TrainConfig(optim=OptimizerConfig(lr=1e-4), lora=lora))
            trainer.train(fixed_batch(trainer.model.config.vocab_size), TokenNLL())
            params = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
            for path, dtype, folder in (("in memory", "bfloat16", None),
                                        ("folder", "float32", Path(tmp) / "weights"),
                                        ("live", "float32", None)):
                engine = LocalEngine(model, dtype=dtype)
                seconds, sent = [], 0.0
                try:
                    for version in range(1, REPEATS + 1):
                        started = time.perf_counter()
                        stats = trainer.sync_weights(engine, version, folder=folder)
                        seconds.append(time.perf_counter() - started)
                        sent = stats["sync/bytes"]
                finally:
                    trainer._readers = None
                    engine.close()
                rows.append({"model": name, "weights": label, "trained_params": params,
                             "path": path, "bytes": sent,
                             "seconds": statistics.median(seconds)})
            del trainer
    return {"repeats": REPEATS, "load_average": os.getloadavg()[0], "rows": rows}


def show(result: dict) -> None:
    rows = result["rows"]
    full = {r["path"]: r for r in rows if r["weights"] == "full"}
    print(f"Weight sync per step (median of {result['repeats']}; load average "
          f"{result['load_average']:.1f})\n")
    print(markdown_table(
        ["model", "weights", "trained params", "path", "MB sent", "seconds", "vs full"],
        [[r["model"], r["weights"], f"{r['trained_params'] / 1e6:.2f} M", r["path"],
          f"{r['bytes'] / 2**20:.1f}", f"{r['seconds']:.3f}",
          "—" if r["weights"] == "full" or r["path"] == "live" else
          f"{full[r['path']]['seconds'] / max(r['seconds'], 1e-9):.1f}x faster"]
         for r in rows]))


if __name__ == "__main__":
    main(__doc__, run, show, "lora_sync")
