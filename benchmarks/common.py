"""What every benchmark module shares: the command line (run, print the table, write the JSON)
and the markdown table they print, which `run.py` collects into one report."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path


def main(doc: str, run: Callable[[bool], dict], show: Callable[[dict], None], name: str) -> None:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small configuration only")
    parser.add_argument("--out", default=f"benchmarks/results/{name}.json")
    args = parser.parse_args()
    result = run(args.quick)
    show(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)


def machine_line() -> str:
    """The CPU (model, count, its bf16 and AMX flags), the GPU, the versions and the load: what a
    reader needs beside any number measured here."""
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = info.splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in lines
                      if line.startswith("flags")), []))
    fast = ([f for f in ("avx512_bf16", "amx_bf16") if f in flags]
            or ["neither avx512_bf16 nor amx_bf16"])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPUs ({cpu}; {', '.join(fast)}), {gpu}, torch {torch.__version__}, "
            f"Python {platform.python_version()}, OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, load average {os.getloadavg()[0]:.2f}")


def machine_limits() -> str:
    """What this machine can do, measured now: the GEMM rate per dtype (2048 x 576 x 1536, the
    shape of SmolLM2's MLP over a training micro-batch; best of five) and the read bandwidth
    (`precision.read_bandwidth`): the denominators of MFU and MBU."""
    import time

    import torch

    from areal_flow.runtime.precision import read_bandwidth

    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.full((2048, 576), 0.01, dtype=dtype)
        b = torch.full((576, 1536), 0.01, dtype=dtype)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        flops = 2 * 2048 * 576 * 1536 / best
        rates.append(f"{str(dtype).removeprefix('torch.')} {flops / 1e12:.2f}")
    return (f"GEMM peak (TFLOP/s) {', '.join(rates)}; read bandwidth "
            f"{read_bandwidth() / 1e9:.1f} GB/s")
