"""The precision a run computes in, chosen by measuring this machine (`dtype="auto"`).

Whether bf16 pays on a CPU cannot be told from its flags: with AMX a bf16 GEMM ran 10x faster
than fp32, on an AVX2-only EPYC 150x slower (emulated), and AVX-512 without BF16 sits between
(`../shared/ENVIRONMENT.md`). So `choose` times a GEMM of the model's own shapes — its hidden
size by its MLP width — in both dtypes and takes bf16 where it is clearly faster: with the rows of a training
micro-batch for training (compute-bound), with the rows of a decode batch for the generation
engine (bound by reading the weights). On a GPU it is bf16 without measuring. A process measures
each shape once; the whole probe stays under a second even where bf16 is emulated.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

DTYPES = ("float32", "bfloat16")
CHOICES = ("auto", *DTYPES)
ROWS = {"train": 256, "decode": 16}
"""Rows of the probe GEMM: a slice of a training micro-batch; a decode batch."""
MARGIN = 1.2
"""bf16 must be this much faster to be chosen: its rounding costs something (the engine's
log-probs then differ from the trainer's), so a near tie stays fp32."""
WIDEST = 2048
"""The probe's inner and outer sizes are capped here: the rate is the same beyond, and an
emulated bf16 GEMM of a large model's shapes would take seconds."""


@attrs.frozen
class Precision:
    """The dtype `choose` settled on, and why."""

    dtype: Literal["float32", "bfloat16"]
    purpose: Literal["train", "decode"]
    seconds: dict[str, float] = attrs.field(factory=dict)
    """The probe GEMM's seconds per dtype ({} when not measured: given, or a GPU)."""
    shape: tuple[int, int, int] | None = None
    """(rows, hidden, MLP width) of the probe."""

    @property
    def flops(self) -> float | None:
        """The probe's FLOP/s in the chosen dtype: the machine's GEMM rate at this model's
        shape (the denominator of MFU)."""
        if self.shape is None or self.dtype not in self.seconds:
            return None
        m, k, n = self.shape
        return 2 * m * k * n / self.seconds[self.dtype]

    def describe(self) -> str:
        if not self.seconds:
            return f"{self.dtype} (given, or a GPU)"
        timings = ", ".join(f"{d} {s * 1e3:.2f} ms" for d, s in self.seconds.items())
        return (f"{self.dtype}, measured ({timings} for a {'x'.join(map(str, self.shape))} "
                f"GEMM)")


_measured: dict[tuple, dict[str, float]] = {}


def choose(dtype: str, model: str | Path, *, purpose: Literal["train", "decode"],
           device: torch.device | str = "cpu") -> Precision:
    """`dtype` itself unless it is "auto"; then bf16 on a GPU, else the faster of fp32 and bf16
    for a GEMM of `model`'s shapes (its config's hidden and intermediate sizes): bf16 when it
    is `MARGIN` times faster."""
    if dtype not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}: {dtype!r}")
    if purpose not in ROWS:
        raise ValueError(f"purpose must be one of {', '.join(ROWS)}: {purpose!r}")
    if dtype != "auto":
        return Precision(dtype, purpose)
    device = torch.device(device)
    if device.type == "cuda":
        return Precision("bfloat16", purpose)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    hidden = config.hidden_size
    width = getattr(config, "intermediate_size", None) or 4 * hidden
    shape = (ROWS[purpose], min(hidden, WIDEST), min(width, WIDEST))
    key = (device.type, shape)
    if key not in _measured:
        _measured[key] = {name: _seconds(shape, getattr(torch, name), device) for name in DTYPES}
    seconds = _measured[key]
    faster = seconds["float32"] > MARGIN * seconds["bfloat16"]
    return Precision("bfloat16" if faster else "float32", purpose, dict(seconds), shape)


def _seconds(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
             budget: float = 0.1) -> float:
    """The fastest of a few timed GEMMs, stopping after `budget` seconds."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = torch.randn(k, n, generator=g).to(device, dtype)
    start = time.perf_counter()
    x @ w  # warm-up: first-call dispatch and allocation
    if (first := time.perf_counter() - start) > budget:
        return first  # slow enough that the warm-up is the measurement (emulated bf16)
    best, spent = float("inf"), 0.0
    for _ in range(10):
        start = time.perf_counter()
        x @ w
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > budget:
            break
    return best


def measured(cfg: Any, model: str, *engines: tuple[str, Any],
             in_process: bool = False) -> tuple[Any, str]:
    """`cfg` with its "auto" dtypes replaced by what was measured (config.yaml records it, so a
    resumed run computes as it did) and the timings, for config.yaml's head. `engines` are the
    trained roles as (config field, `TrainEngine` or None): ``("train", trainer)``; the
    in-process engine's choice (`in_process`) is measured here as `LocalEngine` will do (a
    process measures once, so both agree)."""
    from areal_flow.inference.local import resolve_device

    changes, choices = {}, []
    for field, engine in engines:
        if engine is not None:
            changes[field] = attrs.evolve(getattr(cfg, field), dtype=engine.precision.dtype)
            choices.append(f"{field}.dtype: {engine.precision.describe()}")
    if in_process and getattr(cfg, "inference", None) is not None:
        engine = choose(cfg.inference.dtype, model, purpose="decode",
                        device=resolve_device(cfg.inference.device))
        changes["inference"] = attrs.evolve(cfg.inference, dtype=engine.dtype)
        choices.append(f"inference.dtype: {engine.describe()}")
    note = "precision at start (areal_flow/runtime/precision.py):\n" + "\n".join(choices)
    return attrs.evolve(cfg, **changes), note
