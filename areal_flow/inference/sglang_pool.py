"""Generation pool `sglang`: SGLang servers (or `areal-flow serve`) over HTTP.

One event loop, in a thread the pool owns, does all HTTP and owns all state, so nothing needs a
lock; control methods block the calling thread until it has done them. Parts mixed in: requests
(`sglang_routing`), weights (`sglang_weights`), servers (`sglang_servers`)."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from areal_flow.inference.sglang_routing import Active, GenerationError, Routing
from areal_flow.inference.sglang_servers import Server, Servers, WeightUpdateError
from areal_flow.inference.sglang_weights import LORA_NAME, Weights
from areal_flow.types import Completion, GenerationRequest, WeightUpdate

if TYPE_CHECKING:  # launch's part: loaded by `from_config` for servers another run may use
    from areal_flow.launch.lease import Leases

log = logging.getLogger(__name__)

__all__ = ["LORA_NAME", "GenerationError", "SGLangPool", "WeightUpdateError"]

_COUNTS = ("requests", "resubmissions", "retries", "dead_servers", "generated_tokens",
           "servers_joined", "behind_replies", "servers_left")


class SGLangPool(Routing, Weights, Servers):
    """`GenerationPool` over the servers at `addresses`, or listed in `addresses_file` (one a
    line, ``#`` comments; re-read when it changes). With `tokenizer`, `Completion.text` is decoded
    from all tokens, else the servers' texts are joined. Times are in seconds; a server slower than
    `pause_timeout` or `health_timeout` (SGLang's check: ~1 s, ~20 s while paused) is taken out.
    `retries` counts per control call and per request without new tokens; `base` is a LoRA run's
    base model, loaded on servers that are not its own."""

    def __init__(self, addresses: Sequence[str] | None = None, *,
                 addresses_file: str | os.PathLike | None = None, version: int = 0,
                 tokenizer: str | None = None, request_timeout: float | None = 3600.0,
                 control_timeout: float = 600.0, pause_timeout: float = 30.0,
                 connect_timeout: float = 5.0, health_timeout: float = 30.0,
                 no_server_timeout: float = 600.0, retries: int = 5,
                 refresh_interval: float = 1.0, sticky_capacity: int = 100_000,
                 leases: Leases | None = None, base: str | None = None):
        if (addresses is None) == (addresses_file is None):
            raise ValueError("give exactly one of 'addresses' and 'addresses_file'")
        if retries < 0:
            raise ValueError(f"'retries' must be >= 0: {retries}")
        if refresh_interval <= 0:
            raise ValueError(f"'refresh_interval' must be > 0 seconds: {refresh_interval}")
        self._servers = {address: Server(address) for address in addresses or []}
        self._file = Path(addresses_file) if addresses_file is not None else None
        self._file_key: tuple | None = None
        self._version = version
        self._tokenizer = None
        if tokenizer is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self._generate_timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
        self._control_timeout = httpx.Timeout(control_timeout, connect=connect_timeout)
        self._pause_timeout = httpx.Timeout(pause_timeout, connect=connect_timeout)
        self._health_timeout = httpx.Timeout(health_timeout, connect=connect_timeout)
        self._no_server_timeout = no_server_timeout
        self._retries = retries
        self._refresh_interval = refresh_interval
        self._sticky_capacity = sticky_capacity
        self._leases = leases
        self._refused: dict[str, str] = {}
        """Servers this run may not use now (leased by another run), with the reason."""
        self._base = base
        self._unusable: dict[str, str] = {}
        """Servers that could not load the base model (`base`), with the reason."""

        self._sticky: collections.OrderedDict[str, Server] = collections.OrderedDict()
        self._active: dict[str, Active] = {}
        self._groups: dict[str, list[Server]] = {}
        self._disk: tuple[str, int] | None = None
        self._adapter: tuple[str, int] | None = None
        """The latest LoRA adapter folder and its version, once weights come as adapters."""
        self._over_group = False
        """The latest weights came over a weight-update group (no folder holds them)."""
        self._paused = False
        self._epoch = 0
        """Pauses so far: an abort in another epoch than its submission's is an interruption."""
        self._closed = False
        self._launcher = None
        self._counts: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task] = set()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-pool",
                                        daemon=True)
        self._thread.start()
        try:
            self._call(self._start())
        except BaseException:
            self.close()
            raise

    in_process = False

    @classmethod
    def from_config(cls, config, *, model: str, seed: int = 0, run_dir=None,
                    lora=None) -> SGLangPool:
        """The pool `InferenceConfig` asks for: its servers, or servers launched on `server_gpus`
        (stopped on close) with LoRA enabled for `lora`. Fails, naming them, if none answers."""
        from areal_flow.data.offline import cache_dir
        from areal_flow.launch.lease import Leases, ServerLeased, default_holder
        from areal_flow.inference.launcher import (SGLangLauncher, lora_args, serve_command,
                                                   sglang_command)

        launcher = None
        addresses = list(config.addresses) or None
        if addresses is None and config.addresses_file is None:
            serve = functools.partial(serve_command, dtype=config.dtype, device=config.device,
                                      max_batch_size=config.max_batch_size)
            commands = {"sglang": sglang_command, "areal-flow": serve}
            log_dir = Path(run_dir) / "servers" if run_dir is not None else None
            launcher = SGLangLauncher(model, gpus=config.server_gpus, tp_size=config.tp_size,
                                      random_seed=seed, weight_version=0,
                                      deterministic_inference=config.deterministic,
                                      log_dir=log_dir, command=commands[config.server_program],
                                      extra_args=lora_args(config.server_program, lora))
            addresses = launcher.start()
        try:
            pool = cls(addresses, addresses_file=None if addresses else config.addresses_file,
                       tokenizer=model, request_timeout=config.request_timeout,
                       control_timeout=config.control_timeout, pause_timeout=config.pause_timeout,
                       health_timeout=config.health_timeout,
                       no_server_timeout=config.no_server_timeout,
                       # servers it launched are its own; others may be another run's
                       leases=None if launcher is not None else Leases(
                           config.lease_dir or cache_dir() / "leases",
                           holder=default_holder(run_dir)),
                       # servers it did not launch may hold another run's weights, which a
                       # LoRA update (adapter only) would not replace
                       base=model if launcher is None and lora is not None and lora.enabled
                       else None)
        except BaseException:
            if launcher is not None:
                launcher.stop()
            raise
        pool._launcher = launcher
        waited, deadline = 0.0, time.monotonic() + config.startup_timeout
        while not any(s["in_rotation"] for s in pool.servers()) and not pool._refused \
                and not pool._unusable and time.monotonic() < deadline:
            if waited % 10 < 1:  # servers started with the run may still be loading
                log.warning("waiting for a generation server to answer /health at %s (%.0f s "
                            "of --inference.startup-timeout %g)", addresses or
                            config.addresses_file, waited, config.startup_timeout)
            time.sleep(1.0)
            waited += 1.0
            pool.refresh()
        if not any(s["in_rotation"] for s in pool.servers()):
            pool.close()
            if pool._refused:
                raise ServerLeased("; ".join(pool._refused.values()) +
                                   " (each server here is in use)")
            if pool._unusable:
                raise WeightUpdateError("; ".join(pool._unusable.values()))
            named = addresses or f"the servers listed in {config.addresses_file}"
            raise ConnectionError(f"no generation server answers GET /health at {named} "
                                  f"(waited {config.startup_timeout:g} s, "
                                  "--inference.startup-timeout); start them, or leave "
                                  "--inference.addresses empty to launch")
        return pool

    # -- GenerationPool -------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    async def generate(self, request: GenerationRequest) -> Completion:
        if self._closed:
            raise RuntimeError("the SGLang pool is closed")
        future = asyncio.run_coroutine_threadsafe(self._generate(request), self._loop)
        # Cancelling the caller's task cancels the pool's, which aborts the request on its server.
        return await asyncio.wrap_future(future)

    def pause(self) -> None:
        """Interrupt running requests on every server and hold all requests until `resume`."""
        self._call(self._locked(self._pause_locked))

    def resume(self) -> None:
        self._call(self._locked(self._resume_locked))

    def update_weights(self, update: WeightUpdate) -> None:
        """Load new weights on every server (paused meanwhile) and set `version`: from
        `update.path`, or over the weight-update group (the caller broadcasts meanwhile)."""
        if update.state_dict is not None:
            raise ValueError("the SGLang pool takes weights as a folder ('path') or over a "
                             "weight-update group ('dist_meta'); in-memory state dicts are for "
                             "the local engine")
        self._call(self._locked(lambda: self._update_weights(update)))

    def stats(self) -> dict[str, float]:
        """Counts since the last call, and the servers now."""
        return self._call(self._stats())

    def close(self) -> None:
        """Stop the pool's thread, and the servers it launched (`from_config`)."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=60)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        self._loop.close()
        if self._leases is not None:
            self._leases.release()
        if self._launcher is not None:
            self._launcher.stop()

    # -- more control ---------------------------------------------------------------------

    def abort(self, rid: str | None = None) -> None:
        """Abort `rid` (all when None): it returns ``finish_reason="abort"`` with its tokens so
        far; one racing its submission may finish instead, as with ``/abort_request``."""
        self._call(self._abort(rid))

    def refresh(self) -> None:
        """Re-read the addresses file and health-check the servers now."""
        self._call(self._refresh(force=True))

    def servers(self) -> list[dict[str, Any]]:
        return self._call(self._run(lambda: [
            {"address": s.address, "in_rotation": s.in_rotation, "healthy": s.healthy,
             "stale": s.stale, "inflight": s.inflight, "routed": s.routed,
             "weight_version": s.label} for s in self._servers.values()]))

    def weight_group_size(self, ranks_per_server: int = 1) -> int:
        """World size of a weight-update group: 1 + `ranks_per_server` * answering servers."""
        return self._call(self._run(lambda: 1 + ranks_per_server * len(self._answering())))

    def init_weight_group(self, master_address: str, master_port: int, backend: str = "nccl",
                          group_name: str = "weight_update_group", world_size: int | None = None,
                          ranks_per_server: int = 1) -> None:
        """``/init_weights_update_group`` on every answering server (server i at rank 1 + i *
        ranks_per_server); blocks until the trainer joins as rank 0, so run both concurrently."""
        self._call(self._init_group(master_address, master_port, backend, group_name, world_size,
                                    ranks_per_server))

    def begin_weight_update(self, group_name: str = "weight_update_group") -> None:
        """Open a weight-update session on every group member; a refusal ends all, then retries."""
        self._call(self._locked(lambda: self._begin_session(group_name)))

    def end_weight_update(self, group_name: str = "weight_update_group") -> None:
        """Close the session on every member (``/end_weight_update``), after the last bucket."""
        self._call(self._locked(lambda: self._end_session(group_name)))

    def destroy_weight_group(self, group_name: str = "weight_update_group") -> None:
        self._call(self._locked(lambda: self._destroy_group(group_name)))

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, coro: Coroutine) -> Any:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking SGLang pool call from the pool's own thread")
        if self._closed and self._loop.is_closed():
            coro.close()
            raise RuntimeError("the SGLang pool is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _run(self, fn):
        return fn()

    async def _locked(self, fn):
        async with self._control:
            return await fn()

    def _spawn(self, coro: Coroutine) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self) -> None:
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            timeout=self._control_timeout)
        self._control = asyncio.Lock()
        """Serialises pausing, weight updates, groups and admitting servers."""
        self._refreshing = asyncio.Lock()
        self._changed = asyncio.Condition()
        """Notified on resume and on explicit aborts (requests waiting for either)."""
        self._available = asyncio.Event()
        await self._refresh(force=True)
        self._spawn(self._every(self._refresh_interval, self._refresh, "refreshing"))
        if self._leases is not None:  # separately: a catch-up may hold the refresh
            self._spawn(self._every(self._leases.ttl / 3, self._renew_leases, "renewing leases on"))

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for active in list(self._active.values()):
            active.cancelled = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "_client"):
            await self._client.aclose()

    async def _stats(self) -> dict[str, float]:
        counts, self._counts = self._counts, collections.Counter()
        # behind_replies: replies with tokens of older weights than the pool had when it sent
        # the request (a server that missed an update)
        return {**{key: counts[key] for key in _COUNTS},
                "servers": sum(s.listed for s in self._servers.values()),
                "servers_healthy": len(self._rotation()),
                "servers_stale": sum(s.listed and s.stale for s in self._servers.values()),
                "running": sum(s.inflight for s in self._servers.values())}
