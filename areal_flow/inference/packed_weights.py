"""Linear layers of the engine's model reading weights prepacked for oneDNN's bf16 kernels.

A bf16 `F.linear` on the CPU hands the weight to oneDNN, which lays it out in its blocked (AMX /
AVX-512) format on every call: at decode's few rows that is a second pass over every weight per
step, and the step runs at about half the memory bandwidth. Packed once per weight update, the
same kernel reads the blocked copy directly (the result is the same computation, bit for bit).
The layers keep their own weights: updates load into them as before, and `pack` runs again.
The packed copies are a second copy of those weights (+240 MB resident on SmolLM2-135M).
"""

from __future__ import annotations

import torch

BATCH_HINT = 16
"""Rows oneDNN tunes the packed layout for (decode's batches: any row count works)."""


DEVICES = {"cpu"}
"""Device types whose linear layers run on oneDNN (a GPU's run on cuBLAS: nothing to pack)."""


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packing applies: bf16 weights on a CPU whose oneDNN has bf16 kernels."""
    return (device.type in DEVICES and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(model: torch.nn.Module) -> int:
    """Point every bf16 `nn.Linear` of `model` at a packed copy of its current weight (again
    after each update); returns how many layers read packed weights."""
    packed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16:
            module.forward = linear(module.weight.detach(),
                                    None if module.bias is None else module.bias.detach())
            packed += 1
    return packed


def unpack(model: torch.nn.Module) -> None:
    """Back to `nn.Linear`'s own forward (before an update that changes a layer's kind)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__dict__.pop("forward", None)


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear(x, weight, bias)` reading a packed copy of `weight` (out, in), made now."""
    weight = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")

    return forward
