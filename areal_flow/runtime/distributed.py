"""The training process group, the batch's way to the ranks and back, and small collectives.

On a GPU the default group has NCCL for CUDA tensors and gloo for CPU ones (micro-batch counts,
loss totals, flags, object collectives): an NCCL-only group rejects CPU tensors."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_flow.runtime.microbatch import groups_to_ranks


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


def exit_process(code: int = 0) -> NoReturn:
    """End a finished run's process at once, skipping interpreter finalization, during which a
    gloo thread freeing a collective's tensors can abort a successful run (SIGABRT; 2 in 24
    two-rank runs). Callers close what they opened first; only output buffers are flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


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


def scatter_groups(batch: TensorDict | BaseException | None, rank: int,
                   world_size: int) -> tuple[TensorDict, list[list[int]]]:
    """Rank 0's batch in whole groups to ranks, balanced by tokens: (this rank's rows, each
    rank's row indices). An exception or None from rank 0 (failed rollout) raises on all ranks."""
    payload: list[Any] = [None]
    if rank == 0:
        if isinstance(batch, BaseException) or batch is None:
            error = batch or RuntimeError("rank 0 called train() without a batch")
            payload = [("error", repr(error))]
        else:
            payload = [("ok", groups_to_ranks(batch["group_ids"].tolist(),
                                              batch["attention_mask"].sum(-1).tolist(),
                                              world_size))]
    if world_size > 1:
        dist.broadcast_object_list(payload, src=0)  # small: row indices, or the error
    status, owned = payload[0]
    if status == "error":
        raise RuntimeError(f"rank 0 failed before training: {owned}")
    if world_size == 1:  # skip pickling the batch through an object collective
        return batch[torch.tensor(owned[0], dtype=torch.long)], owned
    shards = [batch[torch.tensor(rows, dtype=torch.long)] for rows in owned] \
        if rank == 0 else None
    received = [None]
    dist.scatter_object_list(received, shards, src=0)
    return received[0], owned


def on_rank0(fn, shard: TensorDict, owned: list[list[int]], rank: int,
             world_size: int) -> TensorDict:
    """`fn` (e.g. advantages) on the full batch gathered on rank 0; each rank gets its rows."""
    if world_size == 1:
        return fn(shard)
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(shard, gathered, dst=0)
    shards = None
    if rank == 0:
        full = fn(torch.cat([s for s in gathered if s.batch_size[0] > 0]))
        shards = list(full.split([len(rows) for rows in owned]))
    received = [None]
    dist.scatter_object_list(received, shards, src=0)
    return received[0]
