"""The training process group, and the small collectives recipes and the run helpers share.

On a GPU machine the default group has a backend for each device its tensors live on: NCCL for
CUDA tensors (FSDP2's gathers and reductions) and gloo for CPU tensors (micro-batch counts, loss
totals, stop flags, and the pickled objects of object collectives). An NCCL-only group rejects
CPU tensors ("No backend type associated with device type cpu"), so every CPU-side collective
would fail at the first step. On a CPU machine gloo serves everything.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}
"""The default group's backend string by the training device's type."""


def served_device_types(backend: str) -> set[str]:
    """The device types a backend string's group can run collectives on."""
    if ":" not in backend:
        return set(dist.Backend.backend_capability[dist.Backend(backend)])
    return {pair.split(":")[0] for pair in backend.split(",")}


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes, or make a one-process world; returns
    (rank, world size, this rank's training device)."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        backend = BACKENDS["cuda" if cuda else "cpu"]
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                    rank=0, world_size=1)
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def shutdown_distributed() -> None:
    """Barrier, then destroy the group: exiting without it sometimes aborts at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def same_on_all_ranks(value: Any) -> Any:
    """Rank 0's value everywhere (a default run folder's time stamp, the converted model)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on one (a stop request arrives at one process)."""
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
