"""The local engine when rows finish one by one: kept rows moved in place, against a copy of
the batch's whole KV cache at every finish.

A GRPO-shaped batch: 4 prompts of 200 tokens x 8 samples (32 rows decoding together, as the
recipe's 2 x 8 at eta = 1), each with its own length from 32 to 128 new tokens, so rows leave
the batch one by one, as EOS makes them do in a run; bf16 where this CPU decodes it faster,
else fp32 (SmolLM2-135M, or the tiny model with --quick). Rows:
  in place — `KVBatch.keep` moves the rows after a finished one down in the same buffers
  copy     — `kv_batch.TRIM_AT = 0`: every finish copies the kept rows into new buffers (before)
Alternating, 3 times each, in one process; the tokens of both are compared (same seeds).

    python benchmarks/kv_keep.py [--quick] [--out benchmarks/results/kv_keep.json]
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
import unittest.mock
from pathlib import Path

from areal_flow.inference import kv_batch
from areal_flow.inference.local import LocalEngine
from areal_flow.runtime import precision
from areal_flow.testing.tiny_model import build_tiny_model
from areal_flow.types import GenerationRequest, SamplingParams
from common import machine_line, main, markdown_table
from decode import smollm2
from engine import in_own_thread

ROWS, GROUP, PROMPT, REPEATS = 32, 8, 200, 3


def run(quick: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        name, path = ("tiny", build_tiny_model(Path(tmp) / "tiny")) if quick else \
            smollm2(Path(tmp))
        dtype = in_own_thread(precision.choose, "auto", path, purpose="decode").dtype
        return in_own_thread(measure, name, path, dtype)


def measure(name: str, path: Path, dtype: str) -> dict:
    engine = LocalEngine(path, dtype=dtype, max_batch_size=ROWS)
    rng = random.Random(0)
    vocab = min(engine.vocab_size, 5000)
    prompts = [[rng.randrange(5, vocab) for _ in range(PROMPT)] for _ in range(ROWS // GROUP)]
    requests = [GenerationRequest(input_ids=prompts[i // GROUP], sampling=SamplingParams(
        max_new_tokens=rng.randrange(32, 129), temperature=1.0, ignore_eos=True, seed=i))
        for i in range(ROWS)]

    async def generate():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    def timed() -> tuple[float, list]:
        started = time.perf_counter()
        out = asyncio.run(generate())
        return time.perf_counter() - started, [o.token_ids for o in out]

    seconds: dict[str, list[float]] = {"in place": [], "copy": []}
    tokens = {}
    try:
        timed()  # warm-up
        for _ in range(REPEATS):
            for label, trim_at in (("in place", kv_batch.TRIM_AT), ("copy", 0.0)):
                with unittest.mock.patch.object(kv_batch, "TRIM_AT", trim_at):
                    took, tokens[label] = timed()
                seconds[label].append(took)
    finally:
        engine.close()
    generated = sum(len(t) for t in tokens["in place"])
    base = statistics.median(seconds["copy"])
    return {"benchmark": "kv_keep", "model": name, "dtype": dtype, "machine": machine_line(),
            "rows": [{"method": label, "median_s": statistics.median(s), "runs_s": s,
                      "tokens_per_s": generated / statistics.median(s),
                      "speedup": base / statistics.median(s)} for label, s in seconds.items()],
            "same_tokens": tokens["in place"] == tokens["copy"], "generated_tokens": generated}


def show(result: dict) -> None:
    print(f"rows finishing one by one, {result['model']} ({result['dtype']}): "
          f"{result['machine']}; {ROWS} rows ({ROWS // GROUP} prompts of {PROMPT} tokens x "
          f"{GROUP}), 32-128 new tokens each; same tokens: {result['same_tokens']}\n")
    print(markdown_table(["keep", "median s", "runs s", "tokens/s", "speed-up"],
                         [[r["method"], f"{r['median_s']:.2f}",
                           " ".join(f"{x:.2f}" for x in r["runs_s"]),
                           f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x"]
                          for r in result["rows"]]))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main(__doc__, run, show, "kv_keep")
