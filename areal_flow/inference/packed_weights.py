"""Linear layers of the engine's model reading weights prepacked for oneDNN's bf16 kernels.

A bf16 `F.linear` on the CPU hands the weight to oneDNN, which lays it out in its blocked (AMX /
AVX-512) format on every call: at decode's few rows that is a second pass over every weight per
step, and the step runs at about half the memory bandwidth. Packed once per weight update, the
same kernel reads the blocked copy directly (the result is the same computation, bit for bit).
The layers keep their own weights: updates load into them as before, and `pack` runs again.
The packed copies are a second copy of those weights (+240 MB resident on SmolLM2-135M).

Projections of one input are packed together (`SIBLINGS`: a Llama-family attention's query, key
and value, an MLP's gate and up): one product reads all their weights, and each projection
returns its slice of it. At decode's rows a product has a fixed cost that small ones pay in full:
measured on SmolLM2's shapes at 8 rows (2 cores, AMX), query, key and value took 90 µs as three
products and 37 µs as one, gate and up 140 and 121 µs; one step calls 30 of each. At decode's
row counts the slices equal the separate products bit for bit; at a prefill's, oneDNN may block
a narrow product (key, value) differently, so those differ in the last bits.
"""

from __future__ import annotations

import torch

BATCH_HINT = 16
"""Rows oneDNN tunes the packed layout for (decode's batches: any row count works)."""

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Attribute names of linear layers that a module always applies to the same input (Llama,
Qwen2 and Mistral attention and MLP modules): packed as one product."""

ATTRIBUTE = "packed_siblings"
"""The module attribute that holds its packed `Siblings` (`siblings(module)` reads it)."""

DEVICES = {"cpu"}
"""Device types whose linear layers run on oneDNN (a GPU's run on cuBLAS: nothing to pack)."""


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packing applies: bf16 weights on a CPU whose oneDNN has bf16 kernels."""
    return (device.type in DEVICES and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(model: torch.nn.Module) -> int:
    """Point every bf16 `nn.Linear` of `model` at a packed copy of its current weight (again
    after each update), siblings (`SIBLINGS`) at one packed product; returns how many layers
    read packed weights."""
    unpack(model)
    packed: set[torch.nn.Module] = set()
    for module in model.modules():
        for names in SIBLINGS:
            layers = [getattr(module, name, None) for name in names]
            if _packable(layers) and len({layer.in_features for layer in layers}) == 1 \
                    and len({layer.bias is None for layer in layers}) == 1:
                together = Siblings(layers)
                for layer, forward in zip(layers, together.forwards()):
                    layer.forward = forward
                module.__dict__[ATTRIBUTE] = together
                packed.update(layers)
    for module in model.modules():
        if module not in packed and _packable([module]):
            module.forward = linear(module.weight.detach(),
                                    None if module.bias is None else module.bias.detach())
            packed.add(module)
    return len(packed)


def unpack(model: torch.nn.Module) -> None:
    """Back to `nn.Linear`'s own forward (before an update that changes a layer's kind)."""
    for module in model.modules():
        module.__dict__.pop(ATTRIBUTE, None)
        if type(module) is torch.nn.Linear:
            module.__dict__.pop("forward", None)


def siblings(module: torch.nn.Module) -> Siblings | None:
    """`module`'s sibling layers packed as one product by the last `pack`, if they were."""
    return module.__dict__.get(ATTRIBUTE)


def _packable(layers: list) -> bool:
    return all(type(layer) is torch.nn.Linear and layer.weight.dtype == torch.bfloat16
               for layer in layers)


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear(x, weight, bias)` reading a packed copy of `weight` (out, in), made now."""
    weight = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")

    return forward


class Siblings:
    """Linear layers of one input packed as one product; `forwards()` gives each layer's
    forward, its slice of the product. The product of an input is computed at the first layer's
    call and kept until every layer has taken its slice (then dropped: a prefill's products
    held in every layer would be a large part of memory); a layer called again, or with
    another input, computes it afresh."""

    def __init__(self, layers: list[torch.nn.Linear]):
        biases = [layer.bias for layer in layers]
        self._forward = linear(torch.cat([layer.weight.detach() for layer in layers]),
                               None if biases[0] is None else torch.cat(biases).detach())
        ends = torch.tensor([layer.out_features for layer in layers]).cumsum(0).tolist()
        self._slices = [slice(end - layer.out_features, end) for end, layer in zip(ends, layers)]
        self._input: torch.Tensor | None = None
        self._product: torch.Tensor | None = None
        self._waiting: set[int] = set()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer's output of `x` side by side, in the order the layers were given."""
        return self._forward(x)

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's output of `x`, in the order the layers were given: one product."""
        product = self._forward(x)
        return [product[..., part] for part in self._slices]

    def forwards(self) -> list:
        return [lambda x, i=i: self._slice(x, i) for i in range(len(self._slices))]

    def _slice(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if x is not self._input or i not in self._waiting:
            self._input, self._product = x, self._forward(x)
            self._waiting = set(range(len(self._slices)))
        out = self._product[..., self._slices[i]]
        self._waiting.discard(i)
        if not self._waiting:
            self._input = self._product = None
        return out
