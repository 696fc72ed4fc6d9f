"""Local engine vs plain `model.generate` on the same requests.

Mixed workload: N requests with different prompt lengths and token budgets, greedy, EOS ignored
so every method generates the same tokens. Three ways to serve them:
  engine      — all N submitted at once to `LocalEngine` (continuous batching)
  hf_batched  — one left-padded `model.generate` batch; it runs until the longest budget, so
                only each request's own budget counts as useful tokens
  hf_serial   — `model.generate` one request at a time
GRPO workload: P prompts of ~200 tokens x G samples of 128 tokens, T = 1 with seeds, EOS ignored:
  engine             — the local engine, a group's prompt prefilled once (prefix sharing)
  engine_no_sharing  — the same with `share_prefix=False`: every sample prefills its prompt
  hf_batched         — one `model.generate(..., num_return_sequences=G)` call
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

import attrs
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from areal_flow.runtime.precision import choose
from areal_flow.inference.local import LocalEngine
from areal_flow.testing.tiny_model import build_tiny_model
from areal_flow.types import GenerationRequest, SamplingParams
from common import main, markdown_table

GRPO = (2, 8, 128)
"""Prompts, samples per prompt, new tokens per sample."""


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


def grpo_prompts(p: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 400) for _ in range(rng.randint(180, 220))] for _ in range(p)]


def run_engine(path: Path, dtype: str, requests: list[GenerationRequest], repeats: int,
               **options) -> tuple[float, int]:
    """Median seconds to serve `requests` submitted at once, and the tokens prefilled."""
    engine = LocalEngine(path, dtype=dtype, max_batch_size=len(requests), **options)

    async def all_of(reqs):
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    def once() -> float:
        start = time.perf_counter()
        outs = asyncio.run(all_of(requests))
        assert sum(len(o.token_ids) for o in outs) == sum(
            r.sampling.max_new_tokens for r in requests)
        return time.perf_counter() - start

    try:  # warm-up: the same prefill, a few decode steps
        asyncio.run(all_of([attrs.evolve(r, sampling=attrs.evolve(r.sampling, max_new_tokens=4))
                            for r in requests]))
        engine.stats()
        seconds = statistics.median(once() for _ in range(repeats))
        return seconds, engine.stats()["prefill_tokens"] // repeats
    finally:
        engine.close()


def run_hf(path: Path, dtype: str, calls: list[tuple[list[list[int]], int]], repeats: int,
           **sampling) -> float:
    """Median seconds of the `model.generate` calls, each (left-padded prompts, new tokens)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    pad = model.config.pad_token_id or 0

    def generate(prompts, budget):
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=budget, min_new_tokens=budget,
                           pad_token_id=pad, **sampling)

    def once() -> float:
        torch.manual_seed(0)
        start = time.perf_counter()
        for prompts, budget in calls:
            generate(prompts, budget)
        return time.perf_counter() - start

    generate(calls[0][0], 4)  # warm-up
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
    n, (p, g, new) = 16, GRPO
    jobs = workload(n)
    useful = sum(m for _, m in jobs)
    mixed = [GenerationRequest(input_ids=q, sampling=SamplingParams(
        max_new_tokens=m, temperature=0, ignore_eos=True)) for q, m in jobs]
    prompts = grpo_prompts(p)
    grpo = [GenerationRequest(input_ids=q, sampling=SamplingParams(
        max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=i * g + j))
        for i, q in enumerate(prompts) for j in range(g)]
    sampled = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    rows, grpo_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": in_own_thread(build_tiny_model, Path(tmp) / "tiny")}
        if not quick:
            models["smollm2-135m-shape"] = in_own_thread(smollm2_sized, Path(tmp) / "smol")
        # bf16 only where it is fast (measured at the 135M shape, as a run measures its model):
        # emulated (AVX2-only CPUs) it is ~6x slower and says nothing
        precision = choose("auto", models[max(models)], purpose="decode").dtype
        dtypes = ("float32", "bfloat16") if precision == "bfloat16" else ("float32",)
        for model_name, path in models.items():
            repeats = 5 if model_name == "tiny" else 1  # tiny runs last ~0.1 s: take a median
            for dtype in dtypes:
                times = {
                    "engine": in_own_thread(run_engine, path, dtype, mixed, repeats)[0],
                    "hf_batched": in_own_thread(run_hf, path, dtype, [(
                        [q for q, _ in jobs], max(m for _, m in jobs))], repeats,
                        do_sample=False),
                    "hf_serial": in_own_thread(run_hf, path, dtype, [([q], m) for q, m in jobs],
                                               repeats, do_sample=False),
                }
                rows += [{"model": model_name, "dtype": dtype, "method": method,
                          "seconds": seconds, "useful_tokens": useful,
                          "tokens_per_s": useful / seconds,
                          "engine_speedup": seconds / times["engine"]}
                         for method, seconds in times.items()]
            runs = {
                "engine": in_own_thread(run_engine, path, precision, grpo, repeats),
                "engine_no_sharing": in_own_thread(run_engine, path, precision, grpo, repeats,
                                                   share_prefix=False),
                "hf_batched": (in_own_thread(run_hf, path, precision, [(prompts, new)], repeats,
                                             num_return_sequences=g, **sampled),
                               g * sum(map(len, prompts))),  # each copy, padding aside
            }
            grpo_rows += [{"model": model_name, "dtype": precision, "method": method,
                           "seconds": seconds, "prefill_tokens": prefilled,
                           "tokens_per_s": p * g * new / seconds,
                           "engine_speedup": seconds / runs["engine"][0]}
                          for method, (seconds, prefilled) in runs.items()]
    return {"benchmark": "engine", "requests": n, "grpo": {"prompts": p, "group": g,
            "new_tokens": new, "prompt_tokens": [len(q) for q in prompts]},
            "torch_threads": torch.get_num_threads(), "rows": rows, "grpo_rows": grpo_rows}


def show(result: dict) -> None:
    print(f"local engine vs model.generate: {result['requests']} mixed requests, "
          f"{result['torch_threads']} threads\n")
    print(markdown_table(
        ["model", "dtype", "method", "seconds", "tokens/s", "engine speed-up"],
        [[r["model"], r["dtype"], r["method"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.0f}",
          f"{r['engine_speedup']:.2f}x"] for r in result["rows"]]))
    grpo = result["grpo"]
    print(f"\nGRPO-shaped: {grpo['prompts']} prompts ({grpo['prompt_tokens']} tokens) x "
          f"{grpo['group']} samples x {grpo['new_tokens']} tokens, T=1\n")
    print(markdown_table(
        ["model", "dtype", "method", "seconds", "tokens/s", "prefill tokens", "engine speed-up"],
        [[r["model"], r["dtype"], r["method"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.0f}",
          r["prefill_tokens"], f"{r['engine_speedup']:.2f}x"] for r in result["grpo_rows"]]))


if __name__ == "__main__":
    main(__doc__, run, show, "engine")
