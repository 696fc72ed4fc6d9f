"""LoRA: low-rank adapters trained on a frozen base model, and how they travel.

peft injects them in place (``q_proj.weight`` becomes ``q_proj.base_layer.weight`` beside
``q_proj.lora_A.default.weight``); only adapter tensors are trained, checkpointed and sent (SGLang
loads them as a PEFT folder). Base weights never move after start."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from areal_flow.config import LoraConfig  # noqa: F401 - its config, in the light module

ADAPTER = "default"
"""peft's name for the one adapter a model carries here."""
_SAVED_PREFIX = "base_model.model."


def add_adapters(model: torch.nn.Module, config: Mapping[str, Any]) -> dict[str, Any]:
    """Inject `config`'s LoRA layers (B = 0, only they train); returns it resolved, JSON-ready."""
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs peft: pip install 'areal-flow[lora]'") from None

    fields = _lora_fields(config)
    peft.inject_adapter_in_model(peft.LoraConfig(**fields), model, adapter_name=ADAPTER)
    resolved = model.peft_config[ADAPTER]
    targets = sorted({name.rsplit(".", 1)[-1] for name in resolved.target_modules})
    if not targets:
        raise ValueError(f"LoRA 'target_modules' {config['target_modules']!r} match no module "
                         f"of {type(model).__name__}")
    return {**fields, "target_modules": targets, "peft_type": "LORA"}


def same_shape(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two resolved adapter configs fit the same layers (rank, scaling, targets)."""
    def key(c):
        return c["r"], float(c["lora_alpha"]), sorted(c["target_modules"])
    return key(a) == key(b)


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter tensor (``...lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def save_adapter(folder: str | Path, state: Mapping[str, torch.Tensor],
                 config: Mapping[str, Any]) -> None:
    """Write the adapter tensors of `state` (the model's own names) as a PEFT folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {_SAVED_PREFIX + name.replace(f".{ADAPTER}.", "."): t.detach().contiguous()
               for name, t in state.items() if is_adapter(name)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(dict(config), indent=1))


def load_adapter(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT folder's config and tensors, named as in a model after `add_adapters`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (folder / name).is_file():
            raise ValueError(f"{folder} is not a PEFT adapter folder: it has no {name}")
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    return config, {re.sub(r"\.(lora_[AB])\.weight", rf".\1.{ADAPTER}.weight",
                           name.removeprefix(_SAVED_PREFIX)): t for name, t in tensors.items()}


def merged(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The base state dict with adapters folded in (W + alpha / r * B @ A), base names only."""
    scale = float(config["lora_alpha"]) / int(config["r"])
    out = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if ".base_layer." in name:
            module, _, leaf = name.rpartition(".base_layer.")
            if leaf == "weight":
                a = state[f"{module}.lora_A.{ADAPTER}.weight"].to(torch.float32)
                b = state[f"{module}.lora_B.{ADAPTER}.weight"].to(torch.float32)
                tensor = (tensor.to(torch.float32) + scale * (b @ a)).to(tensor.dtype)
            name = f"{module}.{leaf}"
        out[name] = tensor
    return out


def _lora_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    fields = ("r", "lora_alpha", "target_modules", "lora_dropout", "bias")
    missing = [f for f in ("r", "lora_alpha", "target_modules") if f not in config]
    if missing:
        raise ValueError(f"a LoRA adapter config needs {missing}: got keys {sorted(config)}")
    return {f: config[f] for f in fields if f in config}
