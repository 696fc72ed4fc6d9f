"""Training throughput of the FSDP2 runtime, against a plain PyTorch loop and the CPU's peak.

For each model and precision: tokens/s of `TrainEngine.train` (one process, token NLL), the same
forward/backward/AdamW step written as a plain loop on the unsharded model (the alternative, in
the same run), and MFU = tokens/s x 6 x parameters / measured matmul peak of this machine.

    python benchmarks/training.py [--quick] [--out benchmarks/results/training.json]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the fixed batch

from areal_flow.config import OptimizerConfig  # noqa: E402
from areal_flow.runtime.precision import choose  # noqa: E402
from areal_flow.runtime.distributed import shutdown_distributed  # noqa: E402
from areal_flow.runtime.engine import TrainConfig, TrainEngine  # noqa: E402
from areal_flow.testing.tiny_model import build_tiny_model  # noqa: E402
from benchmarks.engine import smollm2_sized  # noqa: E402
from common import main, markdown_table  # noqa: E402
from tests.dist_train_script import TokenNLL, fixed_batch  # noqa: E402


def matmul_peak(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of square matmuls, the best of `repeats`."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def engine_tokens_per_s(path: Path, bf16: bool, steps: int) -> float:
    engine = TrainEngine(path, TrainConfig(optim=OptimizerConfig(lr=1e-5),
                                           dtype="bfloat16" if bf16 else "float32",
                                           max_tokens_per_mb=4096))
    batch = fixed_batch(engine.model.config.vocab_size)
    tokens = int(batch["attention_mask"].sum())
    engine.train(batch, TokenNLL())  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        engine.train(batch, TokenNLL())
    return tokens * steps / (time.perf_counter() - start)


def plain_tokens_per_s(path: Path, bf16: bool, steps: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = fixed_batch(model.config.vocab_size)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    tokens = int(mask.sum())

    def step() -> None:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, attention_mask=mask.long()).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss_mask = batch["loss_mask"][:, 1:].float()
        (-(logp * loss_mask).sum() / loss_mask.sum()).backward()
        optimizer.step()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return tokens * steps / (time.perf_counter() - start)


def run(quick: bool = False) -> dict:
    torch.manual_seed(0)
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": build_tiny_model(Path(tmp) / "tiny")}
        if not quick:
            models["smollm2-135m-shape"] = smollm2_sized(Path(tmp) / "smol")
        for name, path in models.items():
            params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
            steps = 10 if name == "tiny" else 2
            # bf16 only where it is fast (measured): emulated (AVX2-only CPUs) it is ~6x slower
            fast = choose("auto", path, purpose="train").dtype == "bfloat16"
            for precision, bf16 in (("fp32", False), ("bf16", True))[:2 if fast else 1]:
                ours = engine_tokens_per_s(path, bf16, steps)
                plain = plain_tokens_per_s(path, bf16, steps)
                rows.append({"model": name, "precision": precision, "params": params,
                             "runtime_tokens_per_s": ours, "plain_tokens_per_s": plain,
                             "runtime_vs_plain": ours / plain,
                             "mfu": ours * 6 * params / peaks[precision]})
    shutdown_distributed()
    return {"benchmark": "training", "peak_flops": peaks, "rows": rows,
            "torch_threads": torch.get_num_threads()}


def show(result: dict) -> None:
    peaks = result["peak_flops"]
    print(f"training throughput: matmul peak fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s, {result['torch_threads']} threads\n")
    print(markdown_table(
        ["model", "precision", "runtime tok/s", "plain loop tok/s", "runtime/plain", "MFU"],
        [[r["model"], r["precision"], f"{r['runtime_tokens_per_s']:.0f}",
          f"{r['plain_tokens_per_s']:.0f}", f"{r['runtime_vs_plain']:.2f}x",
          f"{100 * r['mfu']:.1f}%"] for r in result["rows"]]))


if __name__ == "__main__":
    main(__doc__, run, show, "training")
