"""The precision a run computes in, chosen by measuring this machine (`dtype="auto"`).

Whether bf16 pays on a CPU cannot be told from its flags (AMX: 10x faster than fp32; emulated
on AVX2: 150x slower), so `choose` times a GEMM of the model's hidden size by its MLP width in
both dtypes, with a micro-batch's rows or, for decoding, a decode batch's against one weight per
layer (prepacked as the engine reads them). On a GPU it is bf16, unmeasured."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from areal_flow.config import PolicyLossConfig

DTYPES = ("float32", "bfloat16")
MEASURED = {"cpu"}
"""Device types whose bf16 speed must be measured (a GPU's is known: bf16)."""
SYNCHRONIZE = {"cuda": torch.cuda.synchronize}
CHOICES = ("auto", *DTYPES)
ROWS = {"train": 256, "decode": 16}
"""Rows of the probe GEMM: a slice of a training micro-batch; a decode batch."""
RATE_ROWS = {"cpu": 2048, "cuda": 8192}
"""Rows of MFU's denominator (`gemm_rate`): a micro-batch's, where a GEMM reaches the device's
rate. At 256 rows an H100 read a twentieth of its peak (MFU 16.6 % where 0.8 % was true), and
fp32 on an AMX Xeon 0.136 TFLOP/s (a reasoning-gym run's MFU 123 %)."""
PASS_SECONDS = 5e-3
"""A timed pass repeats the GEMMs this long, so a GPU's synchronize is a small part of it."""
MARGIN = 1.2
"""bf16 must be this much faster to be chosen: its rounding costs (log-prob mismatch)."""
WIDEST = 2048
"""Cap on the probe's sizes: the rate is the same beyond, and emulated bf16 would take seconds."""
DECODE_BYTES = 256 * 2**20
"""The decode probe's fp32 weights stop at this size: beyond any cache, within a second."""


@attrs.frozen
class Precision:
    """The dtype `choose` settled on, and why."""

    dtype: Literal["float32", "bfloat16"]
    purpose: Literal["train", "decode"]
    seconds: dict[str, float] = attrs.field(factory=dict)
    """The probe GEMM's seconds per dtype ({} when not measured: given, or a GPU)."""
    shape: tuple[int, int, int, int] | None = None
    """(rows, hidden, MLP width, weights) of the probe: it multiplies the rows by each weight."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        if not self.seconds:
            return f"{self.dtype} (given, or a GPU)"
        timings = ", ".join(f"{d} {s * 1e3:.2f} ms" for d, s in self.seconds.items())
        m, k, n, count = self.shape
        weights = f" with each of {count} weights" if count > 1 else ""
        return f"{self.dtype}, measured ({timings} for a {m}x{k}x{n} GEMM{weights})"


_measured: dict[tuple, Any] = {}  # probe timings per (device, shape); bandwidth per device


def choose(dtype: str, model: str | Path, *, purpose: Literal["train", "decode"],
           device: torch.device | str = "cpu") -> Precision:
    """`dtype` unless "auto"; then bf16 on a GPU, else bf16 if a GEMM of `model`'s shapes runs
    `MARGIN` times faster in it than in fp32."""
    if dtype not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}: {dtype!r}")
    if purpose not in ROWS:
        raise ValueError(f"purpose must be one of {', '.join(ROWS)}: {purpose!r}")
    if dtype in DTYPES:
        return Precision(dtype, purpose)
    device = torch.device(device)
    if device.type not in MEASURED:  # a GPU: bf16 pays, unmeasured
        return Precision("bfloat16", purpose)
    k, n, layers = _sizes(model)
    packed = purpose == "decode"
    shape = (ROWS[purpose], k, n, max(1, min(layers if packed else 1, DECODE_BYTES // (4 * k * n))))
    key = (str(device), shape, packed)
    if key not in _measured:
        _measured[key] = _seconds(shape, device, packed=packed)
    seconds = _measured[key]
    faster = seconds["float32"] > MARGIN * seconds["bfloat16"]
    return Precision("bfloat16" if faster else "float32", purpose, dict(seconds), shape)


def gemm_rate(model: str | Path, dtype: str, device: torch.device | str = "cpu") -> float:
    """FLOP/s in `dtype` of a GEMM of this model's shapes over `RATE_ROWS` rows: MFU's
    denominator (only `dtype` is timed: a forced, emulated bf16 takes one slow call)."""
    device = torch.device(device)
    k, n, _ = _sizes(model)
    shape = (RATE_ROWS.get(device.type, ROWS["train"]), k, n, 1)
    key = (str(device), shape, dtype)
    if key not in _measured:
        _measured[key] = _seconds(shape, device, dtypes=(dtype,))[dtype]
    return 2 * shape[0] * k * n / _measured[key]


def _sizes(model: str | Path) -> tuple[int, int, int]:
    """(hidden size, MLP width, layers) of `model`'s config, the sizes capped at `WIDEST`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    return (min(config.hidden_size, WIDEST), min(width, WIDEST),
            getattr(config, "num_hidden_layers", 1))


def _seconds(shape: tuple[int, int, int, int], device: torch.device, budget: float = 0.2,
             packed: bool = False, dtypes: tuple[str, ...] = DTYPES) -> dict[str, float]:
    """Each dtype's fastest pass of `shape`, taking turns (so load slows both alike) for `budget`
    seconds; a dtype whose warm-up alone exceeds it (emulated bf16) is timed by that call."""
    from areal_flow.inference import packed_weights

    m, k, n, count = shape
    # the values do not change a GEMM's speed; filling is faster than drawing 100 MB at random
    x = torch.full((m, k), 0.01)
    weights = [torch.full((n, k), 0.01) for _ in range(count)]  # (out, in), as nn.Linear's

    def layers(dtype: torch.dtype) -> list:  # packed as the engine's linear layers read them
        if packed and packed_weights.available(dtype, device) and (
                dtype != torch.float32 or packed_weights.fp32_pays(k, n, count)):
            return [packed_weights.linear(w.to(device, dtype)) for w in weights]
        # into one output tensor: a fresh one per call is the allocator's cost, not the GEMM's
        # (with the trainer's 1 MiB mmap threshold each call faulted its pages in, and bf16 read
        # 1.08 TFLOP/s against 2.5)
        return [functools.partial(torch.mm, mat2=w.to(device, dtype).t(),
                                  out=torch.empty(m, n, dtype=dtype, device=device))
                for w in weights]

    products = {name: (x.to(device, getattr(torch, name)), layers(getattr(torch, name)))
                for name in dtypes}
    del weights

    def timed(name: str, repeat: int = 1) -> float:
        a, calls = products[name]
        return _timed(lambda: [call(a) for call in calls], device, repeat)

    best = {name: timed(name) for name in dtypes}  # a warm-up, kept only if it is that slow
    racing = [name for name in dtypes if best[name] < budget]
    repeat = dict.fromkeys(racing, 1)
    for name in racing:  # passes per timing: doubled until a timing lasts PASS_SECONDS
        while repeat[name] < 4096 and timed(name, repeat[name]) * repeat[name] < PASS_SECONDS:
            repeat[name] *= 2
    best.update({name: float("inf") for name in racing})
    spent = 0.0
    for round_ in range(50):
        if round_ >= 3 and spent > budget:  # at least three passes of each
            break
        for name in racing:
            took = timed(name, repeat[name])
            best[name], spent = min(best[name], took), spent + took * repeat[name]
    return best


def _timed(run: Any, device: torch.device, repeat: int = 1) -> float:
    """Seconds per call of `run()`, `repeat` calls between two of the device's synchronizes."""
    sync = SYNCHRONIZE.get(device.type, lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    sync()
    return (time.perf_counter() - start) / repeat


def read_bandwidth(device: torch.device | str = "cpu") -> float:
    """Bytes/s read from memory (fastest copy of 256 MB; once a process): MBU's denominator."""
    device = torch.device(device)
    key = (str(device), "bandwidth")
    if key not in _measured:
        source = torch.ones(DECODE_BYTES // 4, device=device)
        target = torch.empty_like(source)
        best = min(_timed(lambda: target.copy_(source), device) for _ in range(5))
        _measured[key] = DECODE_BYTES / best
    return _measured[key]


def measured(cfg: Any, model: str, *engines: tuple[str, Any],
             in_process: bool = False) -> tuple[Any, str]:
    """(`cfg` with "auto" dtypes replaced by the measured ones, a note of timings for config.yaml).
    `engines`: (config field, `TrainEngine` or None); `in_process`: the local engine's too."""
    from areal_flow.inference.local import resolve_device

    changes, choices = {}, []
    for field, engine in engines:
        if engine is not None:
            changes[field] = attrs.evolve(getattr(cfg, field), dtype=engine.precision.dtype)
            choices.append(f"{field}.dtype: {engine.precision.describe()}")
            # MFU's denominator, now: timed later, beside a decoding engine, it read 2.5x low
            rate = gemm_rate(model, engine.precision.dtype, engine.device)
            choices.append(f"{field} GEMM rate (MFU's denominator): {rate / 1e12:.3g} TFLOP/s")
    rollouts = None  # the engine's dtype, where known
    if getattr(cfg, "inference", None) is not None:
        rollouts = cfg.inference.dtype if cfg.inference.dtype in DTYPES else None  # not auto
        if in_process:
            engine = choose(cfg.inference.dtype, model, purpose="decode",
                            device=resolve_device(cfg.inference.device))
            changes["inference"] = attrs.evolve(cfg.inference, dtype=engine.dtype)
            choices.append(f"inference.dtype: {engine.describe()}")
            rollouts = engine.dtype
    algorithm = getattr(cfg, "algorithm", None)
    if "train" in changes and isinstance(loss := getattr(algorithm, "loss", None),
                                         PolicyLossConfig):
        chosen = mismatch_default(loss, rollouts, changes["train"].dtype)
        if chosen is not loss:
            changes["algorithm"] = attrs.evolve(algorithm, loss=chosen)
            choices.append(f"algorithm.loss.mismatch_correction: {chosen.mismatch_correction} "
                           f"(auto: rollouts in {rollouts or 'a precision the servers choose'}, "
                           f"training in {changes['train'].dtype})")
    note = "precision at start (areal_flow/runtime/precision.py):\n" + "\n".join(choices)
    return attrs.evolve(cfg, **changes), note


def mismatch_default(loss: PolicyLossConfig, rollouts: str | None,
                     train: str) -> PolicyLossConfig:
    """`loss` with mismatch_correction "auto" settled: "tis" when the rollouts' dtype (None: the
    servers' own) may be narrower than the trainer's, else "none" (TIS is free if they agree)."""
    if loss.mismatch_correction != "auto":
        return loss
    narrower = rollouts is None or getattr(torch, rollouts).itemsize < getattr(torch, train).itemsize
    return attrs.evolve(loss, mismatch_correction="tis" if narrower else "none")
