"""The local engine's weights and version: what an update may change, and how (contract:
`LocalEngine.update_weights`). The engine calls these paused."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from areal_flow.inference import packed_weights
from areal_flow.types import WeightUpdate


class EngineWeights:
    """The weights of the engine's `model`, the version they carry, and the adapter if any."""

    def __init__(self, model: torch.nn.Module, *, version: int, pack: bool):
        self.model = model
        self.version = version
        self.pack = pack
        # Tied tensors (lm_head = embed_tokens) are one weight under several names: receiving
        # any one of them covers all.
        storage: dict[int, set[str]] = {}
        for name, tensor in model.state_dict().items():
            storage.setdefault(tensor.data_ptr(), set()).add(name)
        self._aliases = {name: frozenset(names) for names in storage.values() for name in names}
        self._received: set[str] = set()
        """Tensor names loaded since the version last changed (a bucketed update so far)."""
        self.shared = False
        """Whether the model's tensors are another's (a `live` update kept them)."""
        self.adapter: dict | None = None
        """The PEFT config of the LoRA layers injected by the first adapter update, else None."""
        self.repack()

    def relabel(self, version: int) -> None:
        self.version = version
        self._received = set()

    def update(self, update: WeightUpdate) -> bool:
        """Load `update`; True when its tensors were kept, not copied."""
        if update.lora is not None:
            state, received = self._adapter_update(update), set()
        else:
            if update.state_dict is not None:
                state = update.state_dict
            elif update.path is not None:
                state = AutoModelForCausalLM.from_pretrained(
                    update.path, dtype=self.model.dtype).state_dict()
            else:
                raise ValueError("the local engine takes weights as a state dict or a folder; the "
                                 "distributed group path belongs to the SGLang-protocol server")
            if self.adapter is not None:
                raise ValueError("this engine serves a LoRA adapter: it takes adapters "
                                 "(WeightUpdate.lora), not full weights")
            received = self._covered(set(state), update.version)
        kept = update.live and self._keep_tensors(state)
        if not kept:
            if update.lora is not None:
                from areal_flow.lora import is_adapter

                state = {name: t for name, t in state.items() if is_adapter(name)}
                expected = {name for name in self.model.state_dict() if is_adapter(name)}
                if set(state) != expected:
                    raise ValueError(f"the adapter does not fit the model's LoRA layers: missing "
                                     f"{_some(expected - set(state))}, unexpected "
                                     f"{_some(set(state) - expected)}")
            self._own_tensors()
            try:
                self.model.load_state_dict(state, strict=False)
            except RuntimeError as exc:  # shape mismatches
                raise ValueError(f"weights do not fit the model: {exc}") from exc
        self.shared = kept
        self._received = received
        self.version = update.version
        self.repack()
        return kept

    def _adapter_update(self, update: WeightUpdate) -> dict:
        """The adapter's tensors; LoRA layers are injected at the first adapter."""
        from areal_flow.lora import add_adapters, load_adapter, same_shape

        if self.adapter is None:
            self.adapter = add_adapters(self.model, update.lora)
            self.model.requires_grad_(False)
            self._aliases = {name: frozenset([name]) for name in self.model.state_dict()}
        elif not same_shape(self.adapter, update.lora):
            raise ValueError(
                f"this engine's LoRA layers have rank {self.adapter['r']}, alpha "
                f"{self.adapter['lora_alpha']} on {self.adapter['target_modules']}; an adapter "
                f"of rank {update.lora['r']}, alpha {update.lora['lora_alpha']} on "
                f"{update.lora['target_modules']} needs a new engine")
        return load_adapter(update.path)[1] if update.path is not None else update.state_dict

    def remove_adapter(self) -> None:
        self._own_tensors()
        for name, tensor in self.model.state_dict().items():  # detached: no autograd
            if ".lora_B." in name:
                tensor.zero_()
        self.repack()

    def repack(self) -> None:
        """Repack after every change, `live` tensors too: their owner changes them in place and
        pauses the engine until the next update, which repacks."""
        if self.pack:
            packed_weights.pack(self.model)

    def _own_tensors(self) -> None:
        """Copy `live`-kept tensors before writing into them (never write into their owner's)."""
        if self.shared:
            self.model.load_state_dict(
                {k: t.clone() for k, t in self.model.state_dict().items()}, assign=True)
            self.shared = False

    def _covered(self, names: set[str], version: int) -> set[str]:
        """`names` plus those received before at this version (none once it changes); ValueError if
        none, unknown, or a version change leaves tensors unsent since the last one."""
        if not names:
            raise ValueError("weights do not fit the model: the update holds no tensors")
        if unexpected := names - self._aliases.keys():
            raise ValueError(f"weights do not fit the model: unexpected names {_some(unexpected)}")
        received = self._received | names
        missing = {n for n, aliases in self._aliases.items() if not aliases & received}
        if missing and version != self.version:
            raise ValueError(f"weights do not fit the model: version {version} would leave "
                             f"tensors not updated since version {self.version}: "
                             f"missing names {_some(missing)}")
        return received if version == self.version else set()

    def _keep_tensors(self, state) -> bool:
        """Make the model's parameters and buffers `state`'s tensors, when they all fit."""
        own = self.model.state_dict()
        if set(state) != set(own) or any(
                (t.dtype, t.device, t.shape) != (own[k].dtype, own[k].device, own[k].shape)
                for k, t in state.items()):
            return False
        if any(t.data_ptr() != own[k].data_ptr() for k, t in state.items()):
            self.model.load_state_dict(state, assign=True)
            self.model.requires_grad_(False)
        return True


def _some(names: set[str]) -> str:
    return f"{sorted(names)[:5]} ({len(names)} in all)"
