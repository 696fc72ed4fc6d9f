"""The decoder layers' pointwise parts compiled (`TrainConfig.compile`).

A small model's training step on a CPU spends as much time in element-wise work as in its matrix
products: an RMSNorm is a cast, a square, a mean, a reciprocal root and two products, each a pass
over the activations at memory speed (SmolLM2 at 2,287 tokens in bf16: `aten::mul` and
`aten::copy_` took 1.5 s of a 5.6 s step). torch.compile (inductor) fuses each such chain into
one loop. Compiled here: every child of a decoder layer but its attention (the MLP and the
norms), and the backbone's final norm, each with dynamic shapes (one graph for any number of
tokens). The attention stays eager: row attention splits a pack into its rows
(`packed_attention.py`), a graph per row count; and whole compiled layers measured slower here
(4.93 s a step against 4.55), after a 25 s first step, than these parts after about 3 s more
(benchmarks/README.md, "Training step: compiled MLPs and norms").

On a CPU inductor builds C++: it needs a compiler (g++ or clang++, or $CXX).
"""

from __future__ import annotations

import functools

import torch

SETTINGS = ("auto", "on", "off")


@functools.cache
def cpu_compiler() -> str | None:
    """The C++ compiler inductor would use on a CPU, or None when there is none."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # inductor raises its own InvalidCxxCompiler, or fails to import
        return None


def wanted(setting: str, device: torch.device, option: str = "train.compile") -> bool:
    """Whether `TrainConfig.compile`'s `setting` compiles on `device`. "auto" compiles on a CPU
    with a C++ compiler (measured faster there: benchmarks/README.md); not on a GPU, where it was
    never measured. "on" without a compiler is an error naming `option`."""
    if setting == "off":
        return False
    if device != torch.device("cpu"):  # a GPU (inductor's Triton needs no C++ compiler)
        return setting == "on"
    if cpu_compiler() is None and setting == "on":
        raise ValueError(f"{option} 'on' needs a C++ compiler on a CPU (torch.compile's "
                         "inductor builds C++; none found: install g++ or set $CXX), or "
                         f"{option} 'auto' / 'off'")
    return cpu_compiler() is not None


def compile_pointwise_parts(backbone: torch.nn.Module) -> list[str]:
    """Compile, in place, each decoder layer's children but its attention, and the final norm;
    returns their names. `backbone` is a transformers model whose `_no_split_modules` name its
    decoder layers (a causal LM, or a value model's backbone)."""
    layer_types = set(backbone._no_split_modules or ())
    compiled = []
    for name, module in backbone.named_modules():
        if type(module).__name__ in layer_types:
            for child_name, child in module.named_children():
                if "attn" not in child_name and "attention" not in child_name:
                    child.compile(dynamic=True)
                    compiled.append(f"{name}.{child_name}")
    decoder = backbone.get_decoder() if hasattr(backbone, "get_decoder") else backbone
    norm = getattr(decoder, "norm", None)
    if isinstance(norm, torch.nn.Module):
        norm.compile(dynamic=True)
        compiled.append("norm")
    return compiled
