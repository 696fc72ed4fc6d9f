"""The local engine's decode step against a bare transformers loop and the weight-read bound.

At batch 8 and 16 on SmolLM2-135M (its packaged weights when installed, else a random model of
its shape), in fp32 and, where the CPU has fast bf16, in bf16:
  bare            — `../shared/anchors/bare_decode.py`'s loop: 60-token prompts prefilled once,
                    then the argmax token of every row fed back with transformers' KV cache
  engine          — `LocalEngine`, the same prompts submitted at once, sampled at T = 1 with a
                    seed each (sampling, stop checks and log-probs included), EOS ignored
                    (`LocalEngine.hosted`: the steps run on the measuring thread, as the recipe's
                    trainer runs them while it waits for its batch)
  engine, hosted off — the steps on the engine's own thread, beside the measuring thread that
                    built the engine (as beside a trainer): two OpenMP teams, which libgomp
                    throttles
  engine, X off   — the engine with one optimisation switched off (`kv_slots`, `pack_weights`,
                    `grouped_attention`, `fused_decode`; "packed siblings": query, key and value,
                    gate and up packed as separate products, `packed_weights.SIBLINGS` empty)
  engine, attention X — the fused decode step's attention set to torch's kernel ("sdpa") or
                    to two batched products ("matmul"), not chosen by `faster_attention`
  ragged prompts  — the engine on prompts of 40 to 60 tokens (left-padded: masked attention),
                    with and without `grouped_attention`
A step's time is the gap between two engine steps (`on_step`), or two calls of the bare loop;
the table gives the median and the spread (p90, max), tokens/s at the median, the step against
the bare loop's (speed-up), and MBU: the bytes of the weights over the measured read bandwidth,
divided by the step (the fraction of the weight-read bound a step reaches). Every number comes
from this one invocation. Each measurement runs on a thread of its own that ends with it, and
nothing computes on the main thread: an OpenMP team left alive by another thread would throttle
the next measurement's.

    python benchmarks/decode.py [--quick] [--out benchmarks/results/decode.json]
"""

from __future__ import annotations

import inspect
import asyncio
import os
import statistics
import tempfile
import threading
import time
import unittest.mock
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from areal_flow.inference import decode_step, packed_weights
from areal_flow.inference.local import LocalEngine
from areal_flow.runtime import precision
from areal_flow.testing.tiny_model import build_tiny_model
from areal_flow.types import GenerationRequest, SamplingParams
from common import machine_line, main, markdown_table
from engine import in_own_thread, smollm2_sized

PROMPT, WARMUP = 60, 3
OPTIONS = {"engine": {}, "engine, hosted off": {"hosted": False},
           "engine, fused_decode off": {"fused_decode": False},
           "engine, kv_slots off": {"kv_slots": False},
           "engine, pack_weights off": {"pack_weights": False},
           "engine, packed siblings off": {"siblings": False},
           "engine, grouped_attention off": {"grouped_attention": False},
           "engine, attention sdpa": {"attention": "sdpa"},
           "engine, attention matmul": {"attention": "matmul"},
           # prompts of 40 to 60 tokens, as an RL batch has: the rows are left-padded, so the
           # attention is masked (equal lengths need no mask)
           "engine, ragged prompts": {"ragged": True},
           "engine, ragged prompts, grouped_attention off": {"ragged": True,
                                                             "grouped_attention": False}}


def smollm2(tmp: Path) -> tuple[str, Path]:
    """SmolLM2-135M-Instruct's packaged weights when the `demo` extra is installed, else a random
    model of its shape (the speed is the same)."""
    try:
        from areal_flow.data.packaged import packaged_smollm2

        return "SmolLM2-135M-Instruct", Path(packaged_smollm2())
    except Exception:  # noqa: BLE001 - the extra is optional
        return "SmolLM2-135M shape (random)", in_own_thread(smollm2_sized, tmp / "smol")


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, min(vocab, 1000), (batch, PROMPT), generator=g).tolist()


def bare(path: Path, dtype: str, batch: int, steps: int) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    ids = torch.tensor(prompts(batch, model.config.vocab_size))
    times = []
    # the KV cache as this transformers names it (`cache` from 5.24; the old name warns)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, token = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(WARMUP + steps):
            start = time.perf_counter()
            out = model(token, use_cache=True, **{name: cache})
            cache, token = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return times[WARMUP:]


def engine(path: Path, dtype: str, batch: int, steps: int, ragged: bool = False,
           hosted: bool = True, siblings: bool = True, attention: str | None = None,
           **options) -> tuple[list[float], str | None]:
    """The step times, and the fused decode step's attention (None: transformers' forward)."""
    chosen = (lambda *shape: attention) if attention else decode_step.faster_attention
    with unittest.mock.patch.object(packed_weights, "SIBLINGS",
                                    packed_weights.SIBLINGS if siblings else ()), \
            unittest.mock.patch.object(decode_step, "faster_attention", chosen):
        return engine_steps(path, dtype, batch, steps, ragged, hosted, **options)


def engine_steps(path: Path, dtype: str, batch: int, steps: int, ragged: bool, hosted: bool,
                 **options) -> tuple[list[float], str | None]:
    engine = LocalEngine(path, dtype=dtype, max_batch_size=batch, **options)
    stamps: list[float] = []
    try:
        requests = [GenerationRequest(input_ids=p[(3 * i) % 21 if ragged else 0:],
                                      sampling=SamplingParams(
            max_new_tokens=1 + WARMUP + steps, temperature=1.0, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts(batch, engine.vocab_size))]

        async def serve():
            return await asyncio.gather(*(engine.generate(r) for r in requests))

        def generate():
            if not hosted:
                return asyncio.run(serve())
            requester = threading.Thread(target=asyncio.run, args=(serve(),))
            with engine.hosted():
                requester.start()
                while requester.is_alive():
                    engine.step(timeout=0.01)
            requester.join()

        generate()  # warm-up: allocations, oneDNN's kernel choices
        engine.on_step = lambda _: stamps.append(time.perf_counter())
        generate()
    finally:
        engine.close()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]  # the first stamp ends the prefill
    return gaps[WARMUP:], getattr(engine._decode_step, "attention", None)


def weight_bytes(path: Path, dtype: str) -> int:
    """What a decode step must read at least: each weight once (a tied head is the embedding)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return sum({t.data_ptr(): t.numel() * t.element_size()
                for t in model.state_dict().values()}.values())


def run(quick: bool = False) -> dict:
    steps = 8 if quick else 24
    with tempfile.TemporaryDirectory() as tmp:
        if quick:
            name, path = "tiny", in_own_thread(build_tiny_model, Path(tmp) / "tiny")
        else:
            name, path = smollm2(Path(tmp))
        # nothing computes on this thread: a team of its own would throttle every measurement's
        choice = in_own_thread(precision.choose, "auto", path, purpose="decode")
        dtypes = ("float32", "bfloat16") if choice.dtype == "bfloat16" else ("float32",)
        bandwidth = in_own_thread(precision.read_bandwidth)
        rows = []
        for dtype in dtypes:
            size = in_own_thread(weight_bytes, path, dtype)
            for batch in (8, 16):
                times = {"bare": in_own_thread(bare, path, dtype, batch, steps)}
                attention = {"bare": None}
                for label, options in OPTIONS.items():
                    if "pack" in label and not packed_weights.available(getattr(torch, dtype),
                                                                         torch.device("cpu")):
                        continue  # this CPU's oneDNN packs no weights of this dtype
                    times[label], attention[label] = in_own_thread(engine, path, dtype, batch,
                                                                   steps, **options)
                base = statistics.median(times["bare"])
                for label, seconds in times.items():
                    median = statistics.median(seconds)
                    rows.append({
                        "dtype": dtype, "batch": batch, "method": label,
                        "median_ms": median * 1e3,
                        "p90_ms": statistics.quantiles(seconds, n=10)[-1] * 1e3,
                        "max_ms": max(seconds) * 1e3, "tokens_per_s": batch / median,
                        "speedup_vs_bare": base / median,
                        "mbu": size / bandwidth / median, "weight_bytes": size,
                        "attention": attention[label]})
    return {"benchmark": "decode", "model": name, "machine": machine_line(),
            "read_bandwidth_gbs": bandwidth / 1e9, "steps": steps, "prompt_tokens": PROMPT,
            "torch_threads": torch.get_num_threads(), "rows": rows}


def show(result: dict) -> None:
    print(f"decode steps, {result['model']}: {result['machine']}; read bandwidth "
          f"{result['read_bandwidth_gbs']:.1f} GB/s; {result['prompt_tokens']}-token prompts, "
          f"{result['steps']} steps timed\n")
    print(markdown_table(
        ["dtype", "batch", "method", "attention", "median ms", "p90 ms", "max ms", "tokens/s",
         "vs bare", "MBU"],
        [[r["dtype"], r["batch"], r["method"], r.get("attention") or "-", f"{r['median_ms']:.1f}",
          f"{r['p90_ms']:.1f}", f"{r['max_ms']:.1f}", f"{r['tokens_per_s']:.0f}",
          f"{r['speedup_vs_bare']:.2f}x", f"{r['mbu']:.0%}"] for r in result["rows"]]))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main(__doc__, run, show, "decode")
