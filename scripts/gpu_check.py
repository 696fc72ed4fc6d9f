"""The GPU check (run it through scripts/gpu_check.sh, which installs what the image lacks).

    python scripts/gpu_check.py [--cpu] [--out FILE] [--steps 5]

In order, each part timed:
1. `pytest -m gpu tests/test_gpu.py` on the device: CUDA sampling against the CPU's, every
   collective of a one-rank torchrun under `cpu:gloo,cuda:nccl`, a bf16 FSDP2 step, a LoRA
   trainer's export against the device engine, an interrupted generation on the device engine.
2. The device's limits: a bf16 GEMM's FLOP/s (fp32 too on a CPU) and a copy's bytes/s.
3. A model of a real size built from a config, no weights needed: Qwen2.5-0.5B's shape on a GPU
   (the tiny model with --cpu), its output layer scaled so it speaks the small tokenizer's tokens.
4. The local engine decoding 16 sequences on the device: seconds per step and the fraction of
   the copy bandwidth that reading the weights once per step uses.
5. recipes/gsm8k_grpo.py for `--steps` steps under `torchrun --nproc-per-node 1` (bf16 on a GPU,
   rewards that vary so every step trains): s/step, tokens/s, training MFU (the recipe's
   perf/mfu: 6·params·trained tokens over the GEMM rate of the model's shapes; and the same over
   the device's GEMM peak, worked out here), weight-sync
   seconds, peak GPU memory.
Writes one JSON report (`--out`; on a GPU benchmarks/results/gpu/report.json) and prints a
summary; exits 1 when a part failed. TRL is not in the wheel folder (it needs `datasets`, whose
pyarrow alone is over the 40 MiB the folder may hold), so no TRL ratio is taken here.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                max_position_embeddings=4096, tie_word_embeddings=True)
"""Qwen2.5-0.5B's shape (494M parameters)."""


def describe(device: str) -> dict:
    out = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine()}
    try:
        out["cpu"] = next(line.split(":", 1)[1].strip() for line in
                          Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device == "cuda":
        out.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   gpu_memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30,
                                       1))
    return out


def run_tests(device: str, folder: Path) -> dict:
    xml = folder / "gpu_tests.xml"
    env = {**os.environ, "AREAL_FLOW_CHECK_DEVICE": device,
           "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py",
                           "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    tests = {}
    for case in ET.parse(xml).iter("testcase"):
        problem = next((case.find(k) for k in ("failure", "error", "skipped")
                        if case.find(k) is not None), None)
        tests[case.get("name")] = {
            "outcome": "passed" if problem is None else problem.tag,
            "seconds": round(float(case.get("time", 0)), 2),
            **({"message": (problem.get("message") or "")[:300]} if problem is not None else {})}
    return {"passed": done.returncode == 0 and bool(tests), "tests": tests,
            **({"output": done.stdout[-3000:]} if done.returncode else {})}


def timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def limits(device: str) -> dict:
    """The GEMM peak per dtype (FLOP/s) and the copy bandwidth (bytes read + written per s)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n = 8192 if device == "cuda" else 1024
    out = {}
    for dtype in (torch.bfloat16,) if device == "cuda" else (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out[f"gemm_{str(dtype).removeprefix('torch.')}_flops"] = \
            2 * n**3 / timed(lambda: a @ b, 10 if device == "cuda" else 3, sync)
    size = 2**28 if device == "cuda" else 2**25  # 1 GiB / 128 MiB of fp32
    x, y = torch.empty(size, device=device), torch.empty(size, device=device)
    out["copy_bytes_per_s"] = 2 * 4 * size / timed(lambda: y.copy_(x), 10, sync)
    return out


def build_model(device: str, folder: Path) -> tuple[Path, int]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_flow.testing.tiny_model import build_tiny_model, build_tiny_tokenizer

    if device == "cpu":
        path = build_tiny_model(folder / "model")
    else:
        tokenizer = build_tiny_tokenizer()
        config = Qwen2Config(**QWEN_05B, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():  # logits of the tokenizer's tokens dominate: text, not '' ids
            model.lm_head.weight[:len(tokenizer)] *= 7  # logits ~N(0, 4²) against ~N(0, 0.6²)
        path = folder / "model"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path)).parameters())
    return path, params


def decode(device: str, model: Path, params: int, bandwidth: float,
           profile: Path | None = None) -> dict:
    import asyncio

    from areal_flow.inference.local import LocalEngine
    from areal_flow.types import GenerationRequest, SamplingParams

    dtype = "bfloat16" if device == "cuda" else "float32"
    batch, new = 16, 64
    engine = LocalEngine(model, dtype=dtype, device=device, max_batch_size=batch)

    def once(n: int) -> float:
        requests = [GenerationRequest(input_ids=list(range(10 + i, 42 + i)), sampling=SamplingParams(
            max_new_tokens=n, temperature=0, ignore_eos=True)) for i in range(batch)]

        async def main():
            return await asyncio.gather(*(engine.generate(r) for r in requests))

        start = time.perf_counter()
        asyncio.run(main())
        return time.perf_counter() - start

    try:
        once(4)
        short, long = once(8), once(new)  # the difference: decode steps only
        if profile:  # the kernels of 16 engine tokens (CUPTI sees the engine thread)
            from torch.profiler import ProfilerActivity
            with torch.profiler.profile(activities=[ProfilerActivity.CPU] + (
                    [ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
                once(16)
            profile.mkdir(parents=True, exist_ok=True)
            (profile / "engine_profile.txt").write_text(prof.key_averages().table(
                sort_by="count", row_limit=40, max_name_column_width=60))
    finally:
        engine.close()
    step = (long - short) / (new - 8)
    bare = bare_step(device, model, dtype, batch, new)
    weight_bytes = params * (2 if dtype == "bfloat16" else 4)
    return {"dtype": dtype, "batch": batch, "seconds_per_step": step,
            "tokens_per_s": batch / step,
            "bandwidth_use": weight_bytes / step / bandwidth,
            "bare_seconds_per_step": bare, "engine_over_bare": step / bare}


def bare_step(device: str, model: Path, dtype: str, batch: int, new: int) -> float:
    """A bare transformers decode loop's step on the same model, batch and prompts: the argmax
    token of every row fed back with the KV cache (benchmarks/decode.py's anchor, on the device)."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    prompts = torch.tensor([list(range(10 + i, 42 + i)) for i in range(batch)], device=device)

    # the KV cache as this transformers names it (`cache` from 5.24, which warns at the old name;
    # the GPU image's 5.17 knows only the old one)
    name = "cache" if "cache" in inspect.signature(net.forward).parameters else "past_key_values"

    @torch.inference_mode()
    def once(n: int) -> float:
        start = time.perf_counter()
        out = net(input_ids=prompts, use_cache=True)
        for _ in range(n):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out = net(input_ids=token, use_cache=True, **{name: getattr(out, name)})
        sync()
        return time.perf_counter() - start

    once(4)
    return (once(new) - once(8)) / (new - 8)


def recipe(device: str, model: Path, params: int, peak: float, steps: int, folder: Path) -> dict:
    data = folder / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?",
                                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                            for a in range(10) for b in range(10)))
    shape = (["--rollout.batch-size", "4", "--rollout.group-size", "8",
              "--sampling.max-new-tokens", "128", "--train.dtype", "bfloat16", "--inference.dtype",
              "bfloat16"] if device == "cuda" else
             ["--rollout.batch-size", "2", "--rollout.group-size", "4",
              "--sampling.max-new-tokens", "16", "--train.dtype", "float32", "--inference.dtype",
              "float32"])
    run_dir = folder / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))}
    done = subprocess.run([
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        str(ROOT / "recipes" / "gsm8k_grpo.py"), "--model", str(model), "--dataset", str(data),
        "--run-dir", str(run_dir), "--steps", str(steps), "--eval-size", "0",
        "--save-every", "1000", "--reward", "tests.rewards_for_tests:completion_length",
        "--train.optim.lr", "1e-5", *shape], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"passed": False, "output": done.stderr[-3000:]}
    lines = [m for x in (run_dir / "metrics.jsonl").read_text().splitlines()
             if (m := json.loads(x))["step"] > 0]
    steady = [m for m in lines if m["step"] > 1] or lines  # the first step warms up

    def mean(key):
        values = [m[key] for m in steady if key in m]
        return statistics.fmean(values) if values else None

    # the recipe's own perf/mfu: the tokens the update trained over the measured GEMM rate (a
    # step whose rows were all skipped trains none; the batch's tokens over its few
    # milliseconds of seconds/train once made this mean read 10.8 % on an H200 that gave 1 %)
    mfu = [m["perf/mfu"] for m in steady]
    # the same, worked out here over the device's GEMM peak (`limits`): the recipe's rate at its
    # model's shapes once read a twentieth of an H100's peak, and its MFU 16.6 % for 0.8 %
    of_peak = [6 * params * m["train/tokens"] / (m["seconds/train"] * peak) for m in steady]
    rows = int(shape[1]) * int(shape[3])  # batch size x group size
    trained = sum(m.get("train/skipped_rows", rows) < rows for m in lines)
    return {"passed": True, "steps": len(lines), "trained_steps": trained,
            "seconds_per_step": mean("seconds/step"), "seconds_train": mean("seconds/train"),
            "train_tokens_per_s": mean("tokens_per_second"),
            "generated_tokens_per_s": mean("pool/tokens_per_s"),
            "training_mfu": statistics.fmean(mfu), "mfu_of_gemm_peak": statistics.fmean(of_peak),
            "sync_seconds": mean("sync/send_seconds"),
            "peak_gpu_memory_gb": max((m["memory/peak_gpu_gb"] for m in lines
                                       if "memory/peak_gpu_gb" in m), default=None),
            "peak_rss_gb": max((m["memory/peak_rss_gb"] for m in lines
                                if "memory/peak_rss_gb" in m), default=None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the same steps on the CPU, tiny model")
    parser.add_argument("--out", type=Path, help="the JSON report (default: on a GPU "
                        "benchmarks/results/gpu/report.json, with --cpu gpu_check.json in a "
                        "temporary folder)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", type=Path, help="a folder for the engine's operator profile")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --cpu to check the same steps on the CPU")
    folder = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    out = args.out or (folder / "gpu_check.json" if args.cpu else
                       ROOT / "benchmarks" / "results" / "gpu" / "report.json")
    report: dict = {"machine": describe(device), "seconds": {}}
    began = time.perf_counter()

    def part(name, fn, *a):
        start = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            report[name] = fn(*a)
        except Exception as exc:  # the report still says what ran
            report[name] = {"passed": False, "error": repr(exc)}
        report["seconds"][name] = round(time.perf_counter() - start, 1)
        write()  # after every part: a check stopped at a time limit still reports what ran
        return report[name]

    def write():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")

    part("tests", run_tests, device, folder)
    roof = part("limits", limits, device)
    model, params = build_model(device, folder)
    report["model"] = {"path": str(model), "parameters": params}
    part("decode", decode, device, model, params, roof["copy_bytes_per_s"], args.profile)
    peak = roof[f"gemm_{'bfloat16' if device == 'cuda' else 'float32'}_flops"]
    part("recipe", recipe, device, model, params, peak, args.steps, folder)
    report["seconds"]["total"] = round(time.perf_counter() - began, 1)
    write()
    print(summary(report, out))
    failed = [name for name in ("tests", "decode", "recipe")
              if report[name].get("passed") is False]
    return 1 if failed else 0


def summary(r: dict, out: Path) -> str:
    m, lim, dec, rec = r["machine"], r["limits"], r["decode"], r["recipe"]
    tests = r["tests"].get("tests", {})
    lines = [f"GPU check on {m.get('gpu', m['cpu'])} (torch {m['torch']}); report: {out}",
             f"tests: {sum(t['outcome'] == 'passed' for t in tests.values())}/{len(tests)} passed"
             + "".join(f"\n  {n}: {t['outcome']} {t.get('message', '')}" for n, t in tests.items()
                       if t["outcome"] != "passed"),
             "limits: " + ", ".join(f"{k} {v:.3g}" for k, v in lim.items()
                                    if isinstance(v, float)),
             f"model: {r['model']['parameters'] / 1e6:.1f}M parameters"]
    if "seconds_per_step" in dec:
        lines.append(f"decode ({dec['dtype']}, batch {dec['batch']}): "
                     f"{dec['seconds_per_step'] * 1e3:.1f} ms/step, {dec['tokens_per_s']:.0f} "
                     f"tokens/s, {dec['bandwidth_use']:.1%} of the copy bandwidth; a bare "
                     f"transformers loop {dec['bare_seconds_per_step'] * 1e3:.1f} ms/step "
                     f"(engine/bare {dec['engine_over_bare']:.2f})")
    if rec.get("passed"):
        lines.append(f"recipe: {rec['seconds_per_step']:.2f} s/step, {rec['trained_steps']} of "
                     f"{rec['steps']} steps trained, MFU {rec['training_mfu']:.1%} "
                     f"({rec['mfu_of_gemm_peak']:.1%} of the GEMM peak), "
                     f"{rec['generated_tokens_per_s']:.0f} generated tokens/s, sync "
                     f"{rec['sync_seconds']:.2f} s, peak GPU memory {rec['peak_gpu_memory_gb']} GB")
    else:
        lines.append(f"recipe FAILED: {rec.get('error') or rec.get('output', '')[-500:]}")
    lines.append("seconds: " + ", ".join(f"{k} {v}" for k, v in r["seconds"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
