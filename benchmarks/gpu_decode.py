"""On a GPU: what a decode step of a Qwen2.5-0.5B-shaped model (random weights, batch 16, bf16,
32-token prompts) costs with transformers' DynamicCache, with a StaticCache, and with a
StaticCache under torch.compile(mode="reduce-overhead") (CUDA graphs): the median step after
warm-up, the compile time, and the weight-read bound at 4.1 TB/s (the H200's copy rate measured
by scripts/gpu_check.py). Rows of one invocation; GPU only (not in run.py).

    python benchmarks/gpu_decode.py        # writes $OUT/graphs.json (OUT defaults to .)
"""

import json
import os
import statistics
import time

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, StaticCache

cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=4096, tie_word_embeddings=True)
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
B, P, N = 16, 32, 64
prompts = torch.randint(0, 150000, (B, P), device="cuda")
out_json = {}
def run(forward, cache, n=N):
    times = []
    with torch.inference_mode():
        out = model(input_ids=prompts, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(P, device="cuda"))
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(n):
            torch.cuda.synchronize(); t = time.perf_counter()
            cp = torch.tensor([P + i], device="cuda")
            out = forward(input_ids=tok, past_key_values=cache, use_cache=True,
                          cache_position=cp, position_ids=cp[None].expand(B, 1))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    return statistics.median(times[5:])
out_json["dynamic_eager_ms"] = run(model.forward, DynamicCache(config=cfg)) * 1e3
out_json["static_eager_ms"] = run(model.forward, StaticCache(config=cfg, max_cache_len=P + N + 8)) * 1e3
print(out_json, flush=True)
t = time.perf_counter()
compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
cache = StaticCache(config=cfg, max_cache_len=P + N + 8)
run(compiled, cache, n=8)
out_json["compile_seconds"] = time.perf_counter() - t
out_json["static_graphs_ms"] = run(compiled, StaticCache(config=cfg, max_cache_len=P + N + 8)) * 1e3
weights = sum(p.numel() for p in model.parameters()) * 2
out_json["weight_read_bound_ms"] = weights / 4.1e12 * 1e3
print(json.dumps(out_json), flush=True)
open(os.environ.get("OUT", ".") + "/graphs.json", "w").write(json.dumps(out_json, indent=1))
