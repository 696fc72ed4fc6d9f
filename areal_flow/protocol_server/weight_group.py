"""The server's side of the weight-update group: joined as SGLang's `init_custom_process_group`
joins it, the tensors a trainer broadcasts received, a PEFT adapter loaded keeping the version."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from areal_flow.inference.local import LocalEngine
from areal_flow.lora import load_adapter
from areal_flow.protocol_server.requests import GroupInit
from areal_flow.types import DistributedWeights, WeightUpdate

GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long joining the weight-update group and each broadcast may take."""


def load_adapter_keeping_version(engine: LocalEngine, path: str) -> None:
    """Load a PEFT adapter folder into `engine`, keeping its weight version (SGLang's load
    leaves the version alone; a `WeightUpdate` needs one)."""
    config, state = load_adapter(path)
    was_paused = engine.paused
    engine.pause()  # no token between the load and the version's restore
    try:
        version = engine.version
        engine.update_weights(WeightUpdate(version=max(version, 0), state_dict=state,
                                           lora=config))
        engine.set_version(version)
    finally:
        if not was_paused:
            engine.resume()


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"'dtypes' holds an unknown torch dtype: {name!r}")
    return dtype


def join_group(body: GroupInit) -> dist.ProcessGroup:
    """Join the weight-update group the way SGLang's ``init_custom_process_group`` does, with the
    same private torch helper, so that this server exercises a trainer exactly as SGLang would:
    a TCP-store rendezvous (the trainer, rank 0, hosts the store), keys prefixed with the group
    name, and a process group beside -- never replacing -- the default one."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    url = f"tcp://{body.master_address}:{body.master_port}"
    store, rank, world_size = next(rendezvous(url, body.rank_offset, body.world_size,
                                              timeout=GROUP_TIMEOUT))
    store.set_timeout(GROUP_TIMEOUT)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(body.backend), dist.PrefixStore(body.group_name, store),
        group_name=body.group_name, timeout=GROUP_TIMEOUT,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group ranks are global ranks
    return pg


def receive(group: dist.ProcessGroup, meta: DistributedWeights, dtypes: list[torch.dtype],
             device: torch.device) -> dict:
    """The trainer (rank 0 of the group) broadcasts the tensors in the order of `meta.names`."""
    tensors = {}
    for name, dtype, shape in zip(meta.names, dtypes, meta.shapes):
        tensors[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensors[name], src=0, group=group)
    return tensors
