"""Linear layers reading weights prepacked for oneDNN's CPU kernels, bf16 and fp32.

A CPU `F.linear` re-blocks its weight every call, so a decode step reads the weights at a
fraction of the memory bandwidth; packed once per update, the kernel reads the copy. bf16: bit for
bit, +240 MB on SmolLM2-135M. fp32: all of SmolLM2's linear layers at 8 rows in 26 ms against
73 ms (2 cores, AVX-512 EPYC), within float rounding of `F.linear` (other blocking, other sums),
+540 MB, and packed from a trainer's live tensors too (at each update: they change in place).
`SIBLINGS` share one product: q, k, v 37 vs 90 µs (8 rows, 2 cores, AMX); bit for bit at decode's
row counts, prefill's narrow k, v may differ in the last bits."""

from __future__ import annotations

import functools
import time
import timeit

import torch

BATCH_HINT = 16
"""Rows oneDNN tunes the packed layout for (decode's batches: any row count works)."""

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linear layers a module applies to one input (Llama/Qwen2/Mistral attention, MLP)."""

ATTRIBUTE = "packed_siblings"

DEVICES = {"cpu"}
"""Device types whose linear layers run on oneDNN (a GPU's run on cuBLAS: nothing to pack)."""


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packing applies: on a CPU, fp32 weights, or bf16 where oneDNN has bf16 kernels."""
    return (device.type in DEVICES and torch.backends.mkldnn.is_available()
            and (dtype == torch.float32 or (
                dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())))


MARGIN = 0.8
"""fp32 packs only where packed products take under this fraction of `F.linear`'s time."""

PROBE_BYTES = 64 * 2**20
"""fp32 weights the probe reads per pass at most: more than a cache holds, as decoding reads."""


def pays(model: torch.nn.Module) -> bool:
    """Whether `model`'s linear layers decode faster packed: bf16 always (bit for bit, 2x at
    SmolLM2's size); fp32 when timed so, for its hidden size by MLP width (a tiny model's small
    products lose to oneDNN's fixed cost per call: 6 ms more a step for the test model)."""
    if model.dtype != torch.float32:
        return True
    config = model.config
    width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    return fp32_pays(config.hidden_size, width, getattr(config, "num_hidden_layers", 1))


@functools.cache  # once a process per shape: engines of one model then decode alike
def fp32_pays(hidden: int, width: int, layers: int) -> bool:
    """Whether packed fp32 products of `layers` (hidden x width) weights beat `F.linear`."""
    count = max(1, min(layers, PROBE_BYTES // (4 * hidden * width)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH_HINT, hidden, generator=g)
    weights = [torch.randn(width, hidden, generator=g) * 0.02 for _ in range(count)]
    packed = [linear(w) for w in weights]

    def seconds(layers) -> float:  # the best of 3 passes over every weight, after a warm-up
        return min(timeit.repeat(lambda: [layer(x) for layer in layers],
                                 timer=time.perf_counter, number=1, repeat=4)[1:])

    plain = [functools.partial(torch.nn.functional.linear, weight=w) for w in weights]
    with torch.inference_mode():
        return seconds(packed) < MARGIN * seconds(plain)


def pack(model: torch.nn.Module) -> int:
    """Point every fp32 or bf16 `nn.Linear` at a packed copy of its weight (rerun after each
    update), `SIBLINGS` at one product; returns how many layers read packed weights."""
    unpack(model)
    packed: set[torch.nn.Module] = set()
    for module in model.modules():
        for names in SIBLINGS:
            layers = [getattr(module, name, None) for name in names]
            if _packable(layers) and len({(layer.in_features, layer.bias is None)
                                          for layer in layers}) == 1:
                together = Siblings(layers)
                for i, layer in enumerate(layers):
                    layer.forward = functools.partial(together.output, i=i)
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
    return all(type(layer) is torch.nn.Linear
               and layer.weight.dtype in (torch.float32, torch.bfloat16) for layer in layers)


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear(x, weight, bias)` reading a packed copy of `weight` (out, in), made now."""
    weight = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")

    return forward


class Siblings:
    """Linear layers of one input as one product; `output` is each layer's forward. The
    product is kept from the first call until every layer took its slice (then dropped, saving a
    prefill's memory); a repeated layer or another input recomputes it."""

    def __init__(self, layers: list[torch.nn.Linear]):
        biases = [layer.bias for layer in layers]
        self.product = linear(torch.cat([layer.weight.detach() for layer in layers]),
                              None if biases[0] is None else torch.cat(biases).detach())
        """Every layer's output of an input side by side, in the order the layers were given."""
        ends = torch.tensor([layer.out_features for layer in layers]).cumsum(0).tolist()
        self._slices = [slice(end - layer.out_features, end) for end, layer in zip(ends, layers)]
        self._input: torch.Tensor | None = None
        self._product: torch.Tensor | None = None
        self._waiting: set[int] = set()

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        product = self.product(x)
        return [product[..., part] for part in self._slices]

    def output(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if x is not self._input or i not in self._waiting:
            self._input, self._product = x, self.product(x)
            self._waiting = set(range(len(self._slices)))
        out = self._product[..., self._slices[i]]
        self._waiting.discard(i)
        if not self._waiting:
            self._input = self._product = None
        return out
