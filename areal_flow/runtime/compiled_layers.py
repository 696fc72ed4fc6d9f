"""The decoder layers' pointwise parts compiled (`TrainConfig.compile`).

On a CPU a small model's element-wise work (norms, MLP) costs as much as its GEMMs; inductor
fuses each chain into one loop. Attention stays eager: whole compiled layers measured slower
(4.93 s a step against 4.55). On a CPU inductor builds C++: it needs g++, clang++ or $CXX."""

from __future__ import annotations

import functools

import torch

SETTINGS = ("auto", "on", "off")

ACTIVATION_BUDGET = 0.8
"""The share of a compiled graph's activations torch's min-cut partitioner may keep for backward:
the MLP then keeps its gate and up outputs and recomputes their product (pointwise; at 0.6 it
recomputes up's GEMM too). -0.2 GB saved at 2,287 trained tokens on SmolLM2's shape
(`benchmarks/memory.py saved --budget`)."""


@functools.cache
def cpu_compiler() -> str | None:
    """The C++ compiler inductor would use on a CPU, or None when there is none."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # inductor raises its own InvalidCxxCompiler, or fails to import
        return None


def wanted(setting: str, device: torch.device, option: str = "train.compile") -> bool:
    """Whether `setting` compiles on `device`: "auto" on a CPU with a C++ compiler (a GPU is
    unmeasured); "on" without one raises, naming `option`."""
    if setting == "off":
        return False
    if device != torch.device("cpu"):  # a GPU (inductor's Triton needs no C++ compiler)
        return setting == "on"
    if cpu_compiler() is None and setting == "on":
        raise ValueError(f"{option} 'on' needs a C++ compiler on a CPU (torch.compile's "
                         "inductor builds C++; none found: install g++ or set $CXX), or "
                         f"{option} 'auto' / 'off'")
    return cpu_compiler() is not None


def compile_pointwise_parts(backbone: torch.nn.Module) -> None:
    """Compile in place (dynamic shapes) each decoder layer's children but attention, and the
    final norm. `backbone`'s `_no_split_modules` name its decoder layers."""
    import torch._functorch.config

    # process-wide, read as each graph compiles (at its first call); nothing else compiles here
    torch._functorch.config.activation_memory_budget = ACTIVATION_BUDGET
    layer_types = set(backbone._no_split_modules or ())
    for module in backbone.modules():
        if type(module).__name__ in layer_types:
            for child in module.children():
                # by class: a child's name is no guide (`post_attention_layernorm` is a norm)
                if not type(child).__name__.endswith("Attention"):
                    child.compile(dynamic=True)
    decoder = backbone.get_decoder() if hasattr(backbone, "get_decoder") else backbone
    norm = getattr(decoder, "norm", None)
    if isinstance(norm, torch.nn.Module):
        norm.compile(dynamic=True)
