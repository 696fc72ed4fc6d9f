"""Local engine vs plain `model.generate` on the same mixed-length requests.

N requests with different prompt lengths and token budgets, greedy, EOS ignored so every
method generates the same tokens. Three ways to serve them:
  engine      — all N submitted at once to `LocalEngine` (continuous batching)
  hf_batched  — one left-padded `model.generate` batch; it runs until the longest budget, so
                only each request's own budget counts as useful tokens
  hf_serial   — `model.generate` one request at a time
Throughput is useful tokens per second; the ratio column is engine / method, from the same run.

    python benchmarks/engine.py [--quick] [--out benchmarks/results/engine.json]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from areal_flow.inference.local import LocalEngine
from areal_flow.testing.tiny_model import build_tiny_model
from areal_flow.types import GenerationRequest, SamplingParams
from common import main, markdown_table


def smollm2_sized(path: Path) -> Path:
    """A randomly initialised model with SmolLM2-135M's shape (speed does not need its weights)."""
    build_tiny_model(path)  # tokenizer files; the model is replaced below
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, 400) for _ in range(rng.randint(16, 96))], rng.randint(16, 96))
            for _ in range(n)]


def run_engine(path: Path, dtype: str, jobs, repeats: int) -> float:
    engine = LocalEngine(path, dtype=dtype, max_batch_size=len(jobs))
    requests = [GenerationRequest(input_ids=p, sampling=SamplingParams(
        max_new_tokens=m, temperature=0, ignore_eos=True)) for p, m in jobs]

    async def all_of_them():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    def once() -> float:
        start = time.perf_counter()
        outs = asyncio.run(all_of_them())
        assert sum(len(o.token_ids) for o in outs) == sum(m for _, m in jobs)
        return time.perf_counter() - start

    try:
        asyncio.run(all_of_them())  # warm-up
        return statistics.median(once() for _ in range(repeats))
    finally:
        engine.close()


def run_hf(path: Path, dtype: str, jobs, batched: bool, repeats: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    pad = model.config.pad_token_id or 0

    def generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        budget = max(m for _, m in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=budget, min_new_tokens=budget,
                           do_sample=False, pad_token_id=pad)

    groups = [jobs] if batched else [[job] for job in jobs]
    def once() -> float:
        start = time.perf_counter()
        for group in groups:
            generate(group)
        return time.perf_counter() - start

    generate(groups[0][:2])  # warm-up
    return statistics.median(once() for _ in range(repeats))


def in_own_thread(fn, *args, **kwargs):
    """Run `fn` on a thread that ends with it. OpenMP (torch's libgomp) throttles the spinning
    of every thread team while more team threads exist than CPUs, and a thread's team lives as
    long as the thread: one left on the main thread by building a model or by `generate` slowed
    the engine's decoding in the next measurement 1.8x (bf16, 2 CPUs)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def run(quick: bool = False) -> dict:
    torch.manual_seed(0)
    n = 16
    jobs = workload(n)
    useful = sum(m for _, m in jobs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": in_own_thread(build_tiny_model, Path(tmp) / "tiny")}
        if not quick:
            models["smollm2-135m-shape"] = in_own_thread(smollm2_sized, Path(tmp) / "smol")
        for model_name, path in models.items():
            for dtype in ("float32", "bfloat16"):
                repeats = 5 if model_name == "tiny" else 1  # tiny runs last ~0.1 s: take a median
                times = {
                    "engine": in_own_thread(run_engine, path, dtype, jobs, repeats),
                    "hf_batched": in_own_thread(run_hf, path, dtype, jobs, batched=True,
                                                repeats=repeats),
                    "hf_serial": in_own_thread(run_hf, path, dtype, jobs, batched=False,
                                               repeats=repeats),
                }
                for method, seconds in times.items():
                    rows.append({
                        "model": model_name, "dtype": dtype, "method": method,
                        "seconds": seconds, "useful_tokens": useful,
                        "tokens_per_s": useful / seconds,
                        "engine_speedup": seconds / times["engine"],
                    })
    return {"benchmark": "engine", "requests": n, "torch_threads": torch.get_num_threads(),
            "rows": rows}


def show(result: dict) -> None:
    print(f"local engine vs model.generate: {result['requests']} mixed requests, "
          f"{result['torch_threads']} threads\n")
    print(markdown_table(
        ["model", "dtype", "method", "seconds", "tokens/s", "engine speed-up"],
        [[r["model"], r["dtype"], r["method"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.0f}",
          f"{r['engine_speedup']:.2f}x"] for r in result["rows"]]))


if __name__ == "__main__":
    main(__doc__, run, show, "engine")
