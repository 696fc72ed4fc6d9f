"""Checkpoints of a `TrainEngine`: a `save_pretrained` folder, and the full training state for
exact resume. Every rank calls these; rank 0 writes what is not sharded."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from transformers import AutoTokenizer


if TYPE_CHECKING:
    from areal_flow.runtime.engine import TrainEngine


def save_hf(engine: TrainEngine, path: str | Path,
            tokenizer_from: str | Path | None = None) -> None:
    """A `save_pretrained` folder (tokenizer from `tokenizer_from`); a LoRA policy with its
    adapters merged in, and the adapter alone as a PEFT folder in ``adapter/``."""
    state = get_model_state_dict(
        engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if engine.rank == 0:
        if engine.adapter is not None:
            from areal_flow.lora import merged, save_adapter

            save_adapter(Path(path) / "adapter", state, engine.adapter)
            state = merged(state, engine.adapter)
        engine.model.save_pretrained(path, state_dict=state)
        if tokenizer_from is not None:
            AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    dist.barrier()


def save_checkpoint(engine: TrainEngine, path: str | Path, extra_state: Any = None) -> None:
    """Sharded model and optimizer (DCP), LR schedule, step count, RNG and `extra_state`; of a
    LoRA policy only the adapters and their optimizer state."""
    path = Path(path)
    dcp.save(_trained_state(engine), checkpoint_id=str(path / "dcp"))
    if engine.rank == 0:
        torch.save({"scheduler": engine.scheduler.state_dict(), "steps": engine.steps,
                    "rng": torch.get_rng_state(), "extra_state": extra_state},
                   path / "trainer_state.pt")
    dist.barrier()


def load_checkpoint(engine: TrainEngine, path: str | Path) -> Any:
    """Restore `save_checkpoint`'s state on every rank; returns its `extra_state`."""
    path = Path(path)
    state = _trained_state(engine)
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=engine.adapter is None))
    trainer = torch.load(path / "trainer_state.pt", weights_only=False)
    engine.scheduler.load_state_dict(trainer["scheduler"])
    engine.steps = trainer["steps"]
    torch.set_rng_state(trainer["rng"])
    return trainer["extra_state"]


def _trained_state(engine: TrainEngine) -> dict[str, dict]:
    """{"model": ..., "optim": ...} state dicts; of a LoRA model the adapter's alone (torch's
    `ignore_frozen_params` still keeps a tied LM head: the whole embedding)."""
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    if engine.adapter is not None:
        from areal_flow.lora import is_adapter

        model_state = {k: t for k, t in model_state.items() if is_adapter(k)}
    return {"model": model_state, "optim": optim_state}
