"""The trainer's side of SGLang's weight-update group: join it as rank 0, broadcast in buckets.

SGLang servers join the group with ``/init_weights_update_group`` (``rank_offset`` 1..N) and
receive tensors with ``/update_weights_from_distributed``: one ``broadcast`` from rank 0 per tensor,
in the order of the names the HTTP call lists. The trainer must issue those broadcasts while the
HTTP call is in progress, so each bucket's call runs in a thread while this process broadcasts.

The group is built from public torch classes (a `TCPStore` this process hosts, `PrefixStore`s,
the backend's process-group class) and is used through that object only. It never touches the
default process group, which an FSDP trainer already uses for training. (SGLang, and this project's
`areal-flow serve`, join with torch's private ``_new_process_group_helper``; when the trainer's
default group is bound to a device, that helper would make the new NCCL group split from the
training communicator, which hangs because only trainer rank 0 takes part: NVIDIA-NeMo/RL#3189.
The store keys below are the ones that helper uses, so both sides meet.)
"""

from __future__ import annotations

import concurrent.futures
import datetime
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist

from areal_flow.types import DistributedWeights, WeightUpdate

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class WeightGroupPool(Protocol):
    """What the group path needs from a generation pool (`SGLangPool` has it)."""

    @property
    def version(self) -> int: ...

    @property
    def paused(self) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, update: WeightUpdate) -> None: ...

    def weight_group_size(self, ranks_per_server: int = 1) -> int: ...

    def init_weight_group(self, master_address: str, master_port: int, backend: str,
                          group_name: str, world_size: int | None = None,
                          ranks_per_server: int = 1) -> None: ...

    def begin_weight_update(self, group_name: str) -> None: ...

    def end_weight_update(self, group_name: str) -> None: ...


def _gloo(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    options = dist.ProcessGroupNCCL.Options()  # absent from CPU builds: AttributeError names it
    options._timeout = timeout
    options.is_high_priority_stream = False
    return dist.ProcessGroupNCCL(store, rank, size, options)


_BACKEND_FACTORIES: dict[str, Callable] = {dist.Backend.GLOO: _gloo, dist.Backend.NCCL: _nccl}
"""torch's c10d backends by their torch name; the group's tensors live on the backend's first
device type (``dist.Backend.backend_capability``): CPU for gloo, CUDA for nccl."""


@attrs.define
class WeightGroup:
    """This process as rank 0 of a weight-update group (see `join`)."""

    process_group: Any
    """The c10d backend object (``ProcessGroupGloo``, ``ProcessGroupNCCL``) that broadcasts."""
    device: torch.device
    world_size: int
    group_name: str
    store: dist.Store
    """The rendezvous store this process hosts; kept alive as long as the group."""

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> WeightGroup:
        """Host the rendezvous store at `master_address:master_port` and join as rank 0. Blocks
        until all `world_size` ranks have joined, so the servers' ``/init_weights_update_group``
        must run at the same time (`connect` does both)."""
        name = dist.Backend(backend)  # validates the name and lower-cases it
        if name not in _BACKEND_FACTORIES:
            raise ValueError(f"'backend' must be one of {sorted(_BACKEND_FACTORIES)}: {backend!r}")
        if world_size < 2:
            raise ValueError(f"'world_size' must be >= 2 (the trainer and a server): {world_size}")
        device_type = dist.Backend.backend_capability[name][0]
        device = torch.empty(0, device=device_type).device  # with the current index (cuda:N)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                              timeout=timeout, multi_tenant=True)
        # The key layout of torch's group helper, as the servers use it: the group name, then
        # "<group name>/", then "<device type>/".
        prefixed = dist.PrefixStore(group_name, store)
        prefixed = dist.PrefixStore(f"{group_name}/", prefixed)
        prefixed = dist.PrefixStore(f"{device_type}/", prefixed)
        process_group = _BACKEND_FACTORIES[name](prefixed, 0, world_size, timeout)
        # as torch's helper does on every rank (collective sequence numbers, for desync debugging)
        process_group._set_sequence_number_for_group()
        return cls(process_group=process_group, device=device,
                   world_size=world_size, group_name=group_name, store=store)

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        """Send `tensors` to every server, one broadcast each, in order (they must already be on
        `device`)."""
        for tensor in tensors:
            self.process_group.broadcast(tensor, 0).wait()

    def close(self) -> None:
        """Leave the group (the servers leave with ``/destroy_weights_update_group``)."""
        self.process_group.shutdown()


def connect(
    pool: WeightGroupPool,
    master_address: str,
    master_port: int,
    *,
    backend: str = "nccl",
    group_name: str = "weight_update_group",
    ranks_per_server: int = 1,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> WeightGroup:
    """Make the pool's servers join a new weight-update group while this process joins as
    rank 0; returns once every rank is in. `ranks_per_server` is the servers' tp size (each
    tensor-parallel worker of a server is a rank). A server that joins the pool later is not in the
    group (see `SGLangPool` for what it gets instead)."""
    world_size = pool.weight_group_size(ranks_per_server)
    ex = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="weight-group")
    try:
        servers = ex.submit(pool.init_weight_group, master_address, master_port, backend,
                            group_name, world_size, ranks_per_server)
        trainer = ex.submit(WeightGroup.join, master_address, master_port, world_size,
                            group_name=group_name, backend=backend, timeout=timeout)
        # The first failure is raised at once; the other side would only time out.
        done, _ = concurrent.futures.wait([servers, trainer],
                                          return_when=concurrent.futures.FIRST_EXCEPTION)
        for side in (servers, trainer):
            if side in done and side.exception() is not None:
                raise side.exception()
        servers.result()
        return trainer.result()
    finally:
        ex.shutdown(wait=False)


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
            bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def broadcast_buckets(
    pool: WeightGroupPool,
    group: WeightGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int = 512 * 2**20,
) -> int:
    """Send new weights to the pool's servers over `group`, a bucket at a time, and set the pool's
    version to `version`; returns the number of buckets.

    `named_tensors` may be a generator (e.g. gathering FSDP shards lazily): at most two buckets
    are held at once. Generation is paused for the whole update, so no token comes from a mix of
    old and new tensors; every bucket but the last keeps the pool's current version, and the last
    one sets `version`. The buckets go inside a weight-update session on every server of the
    group (SGLang refuses them outside one), closed after the last bucket even on failure. The
    broadcasts run on the calling thread (NCCL orders them after the work already queued on its
    current CUDA stream). If a server fails or refuses a bucket before it receives it, the
    broadcast waits out the group's timeout; destroy the group and `connect` again.
    """
    was_paused = pool.paused
    pool.pause()
    sent = 0
    try:
        pool.begin_weight_update(group.group_name)
        try:
            chunks = buckets(((n, t.detach().to(group.device).contiguous())
                              for n, t in named_tensors), bucket_bytes)
            current = next(chunks, None)
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-sync") as ex:
                while current is not None:
                    following = next(chunks, None)
                    meta = DistributedWeights(
                        names=[n for n, _ in current],
                        dtypes=[str(t.dtype).removeprefix("torch.") for _, t in current],
                        shapes=[list(t.shape) for _, t in current],
                        group_name=group.group_name,
                    )
                    label = version if following is None else pool.version
                    call = ex.submit(pool.update_weights,
                                     WeightUpdate(version=label, dist_meta=meta))
                    group.broadcast(t for _, t in current)
                    call.result()
                    sent += 1
                    current = following
        finally:
            pool.end_weight_update(group.group_name)
    finally:
        if not was_paused:
            pool.resume()
    return sent



def update_from_folder(pool: Any, folder: Path, version: int, state: dict[str, torch.Tensor], *,
                       model: Any, adapter: dict | None) -> Path:
    """Write `state` as `folder/v<version>` (a `save_pretrained` folder, or a PEFT adapter
    folder with LoRA) and have the pool load it (`/update_weights_from_disk`,
    `/load_lora_adapter`); returns the folder.

    Never writes into the folder the pool last named: a server joining meanwhile loads it under
    that version. Each version gets a folder of its own, written whole under a temporary name
    first; older ones go once the pool names the new one."""
    final, tmp = folder / f"v{version}", folder / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if adapter is not None:
        from areal_flow.lora import save_adapter

        save_adapter(tmp, state, adapter)
    else:
        model.save_pretrained(tmp, state_dict=state)
    shutil.rmtree(final, ignore_errors=True)  # a restart's, never named since
    tmp.rename(final)
    pool.update_weights(WeightUpdate(version=version, path=str(final), lora=adapter))
    for old in folder.iterdir():
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final
