"""Generation pool `sglang`: SGLang servers (or `areal-flow serve`) over HTTP.

One event loop, in a thread the pool owns, does all HTTP and owns all state (servers, in-flight
counts, sticky routes, pause state), so nothing needs a lock. `generate` hands each request to that
loop from the caller's loop; `pause`, `resume`, `update_weights` and the other control methods block
the calling (trainer) thread until the loop has done them.

- **Routing.** Each request goes to the server in rotation with the fewest in-flight requests;
  requests of one `episode_id` stick to one server while it stays in rotation (its prefix cache
  holds the earlier turns), and a resubmitted request goes back to the server it was on.
- **Interruption** (DESIGN.md): `pause` calls ``/pause_generation`` ``{"mode": "abort"}`` on every
  server, so running requests come back with ``finish_reason.type == "abort"`` and their tokens so
  far; the pool keeps those tokens, waits for `resume`, and resubmits prompt + tokens so far with
  the remaining ``max_new_tokens``. Tokens, logprobs and per-token versions are concatenated, so a
  caller never sees the abort. A sampled request with a seed is resubmitted with a seed derived
  from (seed, tokens so far): it stays reproducible for the same interruption points, and the
  continuation does not replay the random numbers that drew the first tokens.
- **Failures.** A connection error, reset or timeout takes the server out of rotation (counted in
  ``dead_servers``) and the request is resubmitted elsewhere with the tokens it had before that
  attempt; nothing already received is lost. So does a reply labelled with a version that is not
  the pool's integer (SGLang's ``"default"``: the server restarted), whose tokens are dropped.
  Taking a server out cancels its ``/generate`` calls in flight, so their requests continue
  elsewhere at once: a frozen server (SIGSTOP) would otherwise hold them for the request timeout.
  The periodic refresh (every `refresh_interval`, 1 s) health-checks (``GET /health``) each server
  in rotation that holds requests, one check at a time, and takes out one that does not answer
  within the health budget; so a server that freezes is out after ~`health_timeout` (31 s in all
  by default), even when no pause comes to notice it. Servers out of rotation are health-checked
  by the same refresh and come back once they answer, after catching up on the weights. SGLang's
  ``/health`` generates one token after ~1 s and, while generation is paused, is held and answers
  503 after ~20 s: the health budget is 30 s, a 5xx is an answer, and no health check runs (or
  counts) while the pool itself is paused. Control calls retry connection errors with backoff
  (stamina).
- **Membership.** With `addresses_file` (one ``host:port`` a line), the file is re-read when it
  changes: new servers join, removed ones leave rotation (their in-flight requests finish). A
  server that joins, or comes back, first gets the latest weights: ``/update_weights_from_disk``
  with the last folder and version, or, before any update, the version label
  (``/update_weight_version``). When the latest weights came over the weight-update group, no
  folder holds them: the server is *stale*, out of rotation (logged, and shown by `servers()` and
  `stats()`), until an update reaches it whole: the next one from disk, or one over a new group
  (`areal_flow.runtime.weight_sync.connect` includes stale servers). Catching a server up holds
  the control lock, so a `pause` meanwhile waits for it; a joining server is not caught up while
  the pool is paused (a weight update may be under way), and is itself paused while it loads:
  SGLang answers 400 to an update it applied when requests still run (the cache flush after it
  is refused), so the pool updates only paused servers and, after a 400, reads the version the
  server reports before deciding. A server new to the pool is first sent ``/end_weight_update``:
  a run killed between begin and end leaves SGLang's session open, refusing every later begin,
  and anyone may end it; a refused begin likewise ends every member's session and begins again.
- **LoRA.** Weights that come as a LoRA adapter folder (`WeightUpdate.lora`) are loaded on each
  server as ``/unload_lora_adapter`` of the previous one, ``/load_lora_adapter`` under
  `LORA_NAME`, then ``/update_weight_version``; from then on every ``/generate`` names it in
  ``lora_path``, and a joining server gets the latest adapter the same way. The servers must run
  with LoRA enabled (`from_config` launches them so). An adapter runs over whatever base a
  server holds, so a LoRA run attaching to servers (`base`) first loads its base model on each
  from disk, unless the server reports that folder and was never updated; one that cannot is
  refused, named with the ``model_path`` and version it reports.
- **Leases.** With `leases` (`lease.py`; `from_config` for servers it did not launch), the pool
  holds a server's lease before it sends it anything and renews it every third of its time, in
  a task of its own (a catch-up must not delay it): a
  server another live run holds is never admitted (logged, and `from_config` fails naming the holder when no server is
  left), so two runs never write weights into one server.
- **Request ids.** Each attempt goes out under a fresh id: 32 hex digits, a dash, and the
  request's own id: SGLang's ``/abort_request`` aborts every id that starts with the given one, so
  no id sent may be a prefix of another.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import stamina

from areal_flow.inference.lease import Leases, ServerLeased, default_holder
from areal_flow.types import (Completion, FinishReason, GenerationRequest, WeightUpdate,
                              derived_seed)

log = logging.getLogger(__name__)

LORA_NAME = "policy"
"""The name the policy's LoRA adapter is loaded under on every server."""

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class GenerationError(RuntimeError):
    """A request failed for good: refused by a server, or resubmitted too often in vain."""


class WeightUpdateError(RuntimeError):
    """A server refused a weight update or a weight-update group call."""


class _ServerDown(Exception):
    """The server did not answer (connection refused/reset, timeout)."""


class _ServerError(Exception):
    """The server answered 5xx: it is alive (its health checks decide more), the request is
    retried, on another server where there is one."""


@attrs.define(eq=False)
class _Server:
    address: str
    listed: bool = True
    """In the address list (a server removed from the file finishes its requests, then goes)."""
    healthy: bool = False
    """Answering and caught up with the latest weights."""
    inflight: int = 0
    routed: int = 0
    label: str | None = None
    """The weight version the server reports."""
    stale: bool = False
    """Answering, but without the latest weights (they came over a group it was not in)."""
    posts: set[asyncio.Task] = attrs.field(factory=set)
    """Its /generate calls in flight: taking it out cancels them (a frozen server never answers)."""
    checking: bool = False
    """A liveness check (`_check_alive`) is under way."""
    known: bool = False
    """This pool caught it up, and it still reports the label given then: its weights are this
    run's. (Another run, or a restart, changes the label.)"""

    @property
    def url(self) -> str:
        return self.address if "://" in self.address else f"http://{self.address}"

    @property
    def in_rotation(self) -> bool:
        return self.listed and self.healthy and not self.stale


@attrs.define(eq=False)
class _Active:
    """A `generate` call while the pool holds it: everything received so far."""

    request: GenerationRequest
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    texts: list[str | None] = attrs.field(factory=list)
    server: _Server | None = None
    failed_on: _Server | None = None
    """The server that last answered 5xx: the next try prefers any other."""
    wire_rid: str | None = None
    posted: bool = False
    cancelled: bool = False
    failures: int = 0
    """Server failures since the last token received."""
    stalls: int = 0
    """Aborts nobody asked for (no pause, no cancellation) since the last token received."""

    @property
    def remaining(self) -> int:
        return self.request.sampling.max_new_tokens - len(self.tokens)


def _resubmission_seed(seed: int | None, produced: int) -> int | None:
    return seed if seed is None or produced == 0 else derived_seed(seed, produced)


def _version(label: Any) -> int:
    try:
        return int(label)
    except (TypeError, ValueError):
        # the pool labels every server when it joins: this one restarted since (SGLang's
        # "default"), so its weights are unknown
        raise _ServerDown(f"it reports weight version {label!r}, not the pool's label") from None


def _token_versions(meta: dict, n: int) -> list[int]:
    """Per-token versions from ``weight_versions`` spans, else ``weight_version`` for all."""
    spans = meta.get("weight_versions")
    if not spans:
        return [_version(meta.get("weight_version"))] * n
    versions: list[int | None] = [None] * n
    for span in spans:
        label = _version(span["version"])
        for i in range(span["start"], min(span["end"], n)):
            versions[i] = label
    if None in versions:
        raise GenerationError(f"'weight_versions' does not cover the {n} output tokens: {spans}")
    return versions  # type: ignore[return-value]


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict) and body.get("error_message"):  # LoRA replies (LoRAUpdateOutput)
        return str(body["error_message"])
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _lora_error(response: httpx.Response) -> str:
    """SGLang's LoRA error (``error_message``), never matched in the printed reply."""
    try:
        return str(response.json().get("error_message") or "")
    except (ValueError, AttributeError):
        return ""


class SGLangPool:
    """`GenerationPool` over SGLang servers (see the module docstring).

    Args:
        addresses: ``host:port`` (or URL) of each server.
        addresses_file: a file of addresses, one a line (``#`` comments), re-read when it changes.
            Give exactly one of `addresses` and `addresses_file`.
        version: the version of the weights the servers start with.
        tokenizer: a tokenizer folder/name; when given, `Completion.text` is decoded here from all
            tokens (exact across resubmissions, and works with ``--skip-tokenizer-init``);
            otherwise it joins the servers' texts of each resubmission.
        request_timeout: seconds one ``/generate`` call may take (None: no limit).
        control_timeout: seconds a control call may take (weight loads, joining a group).
        pause_timeout: seconds a pause or resume call may take (they take well under a second);
            a server slower than that (frozen, overloaded) is taken out of rotation instead of
            holding up the weight update for `control_timeout`.
        connect_timeout: seconds to open a connection.
        health_timeout: seconds a health check may take (SGLang's takes ~1 s, and up to ~20 s
            before answering 503 while its generation is paused); a server holding requests that
            does not answer one within this is taken out.
        no_server_timeout: seconds a request waits for a server in rotation before failing.
        retries: retries of a control call on connection errors, and resubmissions of one request
            after server failures (or unexplained aborts) without new tokens.
        refresh_interval: seconds between re-reading the addresses file and health-checking
            servers out of rotation, and those in rotation that hold requests.
        sticky_capacity: most episode ids remembered for sticky routing (oldest forgotten).
        leases: this run's leases (`lease.py`), for servers another run may use too.
        base: a LoRA run's base model, as the servers can load it (a folder or hub name), when
            they are not its own: a LoRA adapter runs over whatever base a server holds, so a
            server loads this first (from disk) unless it still holds the model it started with.
    """

    def __init__(
        self,
        addresses: Sequence[str] | None = None,
        *,
        addresses_file: str | os.PathLike | None = None,
        version: int = 0,
        tokenizer: str | None = None,
        request_timeout: float | None = 3600.0,
        control_timeout: float = 600.0,
        pause_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        health_timeout: float = 30.0,
        no_server_timeout: float = 600.0,
        retries: int = 5,
        refresh_interval: float = 1.0,
        sticky_capacity: int = 100_000,
        leases: Leases | None = None,
        base: str | None = None,
    ):
        if (addresses is None) == (addresses_file is None):
            raise ValueError("give exactly one of 'addresses' and 'addresses_file'")
        if retries < 0:
            raise ValueError(f"'retries' must be >= 0: {retries}")
        if refresh_interval <= 0:
            raise ValueError(f"'refresh_interval' must be > 0 seconds: {refresh_interval}")
        self._addresses = list(addresses or [])
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
        """This run's leases on its servers (`lease.py`): none taken when None."""
        self._refused: dict[str, str] = {}
        """Servers this run may not use now (leased by another run), with the reason."""
        self._base = base
        self._unusable: dict[str, str] = {}
        """Servers that could not load the base model (`base`), with the reason."""

        self._servers: dict[str, _Server] = {}
        self._sticky: collections.OrderedDict[str, _Server] = collections.OrderedDict()
        self._active: dict[str, _Active] = {}
        self._groups: dict[str, list[_Server]] = {}
        self._disk: tuple[str, int] | None = None
        """The last update from disk: (folder, version)."""
        self._adapter: tuple[str, int] | None = None
        """The latest LoRA adapter folder and its version, once weights come as adapters."""
        self._over_group = False
        """The latest weights came over a weight-update group (no folder holds them)."""
        self._paused = False
        self._epoch = 0
        """Pauses so far: an abort during another epoch than its submission's is an interruption."""
        self._closed = False
        self._launcher = None
        """Servers this pool launched (`from_config`), stopped by `close`."""
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
        """The pool a recipe asked for with `InferenceConfig`: the given servers, or servers it
        launches on `server_gpus` (stopped when the pool closes), with LoRA enabled for the
        trainer's `lora` (`areal_flow.lora.LoraConfig`). Fails at once, naming the addresses,
        if no server answers."""
        from areal_flow.data.offline import cache_dir
        from areal_flow.inference.launcher import (
            SGLangLauncher,
            lora_args,
            serve_command,
            sglang_command,
        )

        launcher = None
        addresses = list(config.addresses) or None
        version = 0
        if addresses is None and config.addresses_file is None:
            serve = functools.partial(serve_command, dtype=config.dtype, device=config.device,
                                      max_batch_size=config.max_batch_size)
            commands = {"sglang": sglang_command, "areal-flow": serve}
            log_dir = Path(run_dir) / "servers" if run_dir is not None else None
            launcher = SGLangLauncher(model, gpus=config.server_gpus, tp_size=config.tp_size,
                                      random_seed=seed, weight_version=version,
                                      deterministic_inference=config.deterministic,
                                      log_dir=log_dir, command=commands[config.server_program],
                                      extra_args=lora_args(config.server_program, lora))
            addresses = launcher.start()
        try:
            pool = cls(addresses, addresses_file=None if addresses else config.addresses_file,
                       version=version, tokenizer=model, request_timeout=config.request_timeout,
                       control_timeout=config.control_timeout,
                       pause_timeout=config.pause_timeout,
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
            refused = list(pool._refused.values())
            pool.close()
            if refused:
                raise ServerLeased("; ".join(refused) + " (each server here is in use)")
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
        """Load new weights on every server and set `version` (pausing meanwhile unless already
        paused): from a folder (`update.path`), or over the weight-update group
        (`update.dist_meta`; the caller broadcasts the tensors while this call runs)."""
        if update.state_dict is not None:
            raise ValueError(
                "the SGLang pool takes weights as a folder ('path') or over a weight-update group "
                "('dist_meta'); in-memory state dicts are for the local engine"
            )
        self._call(self._update_weights(update))

    def stats(self) -> dict[str, float]:
        """Counts since the last call (requests, resubmissions after an interruption, retries,
        servers taken out, tokens) and the servers now."""
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
        """Explicit cancellation: the request (every request when `rid` is None) returns with
        ``finish_reason="abort"`` and its tokens so far. A request whose submission races with
        the abort may finish instead, as with SGLang's ``/abort_request``."""
        self._call(self._abort(rid))

    def refresh(self) -> None:
        """Re-read the addresses file and health-check servers out of rotation now (the periodic
        refresh does the same every `refresh_interval` seconds, and starts the liveness checks of
        servers holding requests)."""
        self._call(self._refresh(force=True))

    def servers(self) -> list[dict[str, Any]]:
        """The servers known now: address, whether in rotation, answering (healthy), waiting for
        weights it missed (stale), in-flight requests, version."""
        def snapshot() -> list[dict[str, Any]]:
            return [{"address": s.address, "in_rotation": s.in_rotation, "healthy": s.healthy,
                     "stale": s.stale, "inflight": s.inflight, "routed": s.routed,
                     "weight_version": s.label}
                    for s in self._servers.values()]
        return self._call(self._run(snapshot))

    def weight_group_size(self, ranks_per_server: int = 1) -> int:
        """World size of a weight-update group over the answering servers now (stale ones too):
        the trainer plus `ranks_per_server` (the servers' tp size) ranks per server."""
        return self._call(self._run(lambda: 1 + ranks_per_server * len(self._answering())))

    def init_weight_group(self, master_address: str, master_port: int, backend: str = "nccl",
                          group_name: str = "weight_update_group", world_size: int | None = None,
                          ranks_per_server: int = 1) -> None:
        """``/init_weights_update_group`` on every answering server (server i at rank offset
        1 + i * ranks_per_server); blocks until the trainer joins as rank 0 too, so run it
        concurrently with that (`areal_flow.runtime.weight_sync.connect`). `world_size`, when
        given, must match those servers."""
        self._call(self._init_group(master_address, master_port, backend, group_name, world_size,
                                    ranks_per_server))

    def begin_weight_update(self, group_name: str = "weight_update_group") -> None:
        """Open a weight-update session (``/begin_weight_update``) on every member of the group:
        SGLang refuses ``/update_weights_from_distributed`` outside one. On failure, the sessions
        opened are closed again."""
        self._call(self._locked(lambda: self._begin_session(group_name)))

    def end_weight_update(self, group_name: str = "weight_update_group") -> None:
        """Close the session on every member (``/end_weight_update``), after the last bucket."""
        self._call(self._locked(lambda: self._end_session(group_name)))

    def destroy_weight_group(self, group_name: str = "weight_update_group") -> None:
        self._call(self._destroy_group(group_name))

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, coro: Coroutine) -> Any:
        """Run `coro` on the pool's loop and wait for it (from any other thread)."""
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
            timeout=self._control_timeout,
        )
        self._control = asyncio.Lock()
        """Serialises pausing, weight updates, groups and admitting servers."""
        self._refreshing = asyncio.Lock()
        self._changed = asyncio.Condition()
        """Notified on resume and on explicit aborts (requests waiting for either)."""
        self._available = asyncio.Event()
        for address in self._addresses:
            self._servers[address] = _Server(address)
        await self._refresh(force=True)
        self._spawn(self._refresh_periodically())
        if self._leases is not None:
            self._spawn(self._renew_periodically())

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
        return {
            "requests": counts["requests"],
            "resubmissions": counts["resubmissions"],
            "retries": counts["retries"],
            "dead_servers": counts["dead_servers"],
            "generated_tokens": counts["generated_tokens"],
            "servers": sum(s.listed for s in self._servers.values()),
            "servers_healthy": len(self._rotation()),
            "servers_stale": sum(s.listed and s.stale for s in self._servers.values()),
            "servers_joined": counts["servers_joined"],
            # replies with tokens of older weights than the pool had when it sent the request:
            # a server that missed an update
            "behind_replies": counts["behind_replies"],
            "servers_left": counts["servers_left"],
            "running": sum(s.inflight for s in self._servers.values()),
        }

    # -- generation -----------------------------------------------------------------------

    async def _generate(self, request: GenerationRequest) -> Completion:
        if request.rid in self._active:
            raise ValueError(f"request id {request.rid!r} is already being generated")
        active = self._active[request.rid] = _Active(request)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            return await self._complete(active)
        except asyncio.CancelledError:
            if self._closed:
                raise RuntimeError("the SGLang pool was closed") from None
            raise
        finally:
            self._tasks.discard(task)
            del self._active[request.rid]

    async def _complete(self, active: _Active) -> Completion:
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: not self._paused or active.cancelled)
            if active.cancelled:
                return self._completion(active, "abort")
            server = await self._route(active)
            if self._paused:  # paused while waiting for a server: wait for resume first
                continue
            active.wire_rid = f"{uuid.uuid4().hex}-{active.request.rid}"
            active.server, active.posted = server, True
            epoch, sent_at = self._epoch, self._version
            server.inflight += 1
            try:
                reply = await self._on_server(server, self._post_generate(server,
                                                                          self._body(active)))
                versions = _token_versions(reply["meta_info"], len(reply["output_ids"]))
                if versions and min(versions) < sent_at:  # never, when joining servers catch up
                    self._counts["behind_replies"] += 1
            except (_ServerDown, _ServerError) as exc:
                if isinstance(exc, _ServerDown):
                    self._take_out(server, exc)
                else:  # it answered, so it is alive; the next try goes elsewhere if it can
                    active.failed_on = server
                    log.warning("retrying request %r: %s", active.request.rid, exc)
                active.failures += 1
                if active.failures > self._retries:
                    raise GenerationError(f"request {active.request.rid!r} failed "
                                          f"{active.failures} times; last: {exc}") from exc
                self._counts["retries"] += 1
                continue
            except asyncio.CancelledError:
                if not self._closed:  # closing the connection aborts it too; this is explicit
                    self._spawn(self._quietly(self._post(server, "/abort_request",
                                                         {"rid": active.wire_rid})))
                raise
            finally:
                server.inflight -= 1
                active.posted = False

            finish = self._extend(active, reply, versions)
            reason = _FINISH_REASONS.get(finish.get("type"))
            if reason is None:
                raise GenerationError(f"unknown finish_reason from {server.address}: {finish}")
            if reason != "abort":
                return self._completion(active, reason)
            if active.cancelled:
                return self._completion(active, "abort")
            if active.remaining == 0:
                return self._completion(active, "length")
            status = finish.get("status_code")
            if isinstance(status, int) and status >= 400:
                raise GenerationError(f"{server.address} aborted request {active.request.rid!r} "
                                      f"({status}): {finish.get('message')}")
            if epoch == self._epoch and not self._paused:  # nobody here paused it
                active.stalls += 1
                if active.stalls > self._retries:
                    raise GenerationError(f"{server.address} keeps aborting request "
                                          f"{active.request.rid!r}: {finish.get('message')}")
            self._counts["resubmissions"] += 1

    async def _route(self, active: _Active) -> _Server:
        """The server for the next attempt: the previous one, else the episode's, else the least
        loaded (ties: the one given fewer requests so far); after a 5xx answer, any other server
        in rotation before the one that gave it."""
        rotation = self._rotation()
        if not rotation:
            try:
                async with asyncio.timeout(self._no_server_timeout):
                    while not (rotation := self._rotation()):
                        self._available.clear()
                        await self._available.wait()
            except TimeoutError:
                raise GenerationError(
                    f"no SGLang server in rotation for {self._no_server_timeout} s; known: "
                    f"{sorted(self._servers)}") from None
        episode = active.request.episode_id
        sticky = self._sticky.get(episode) if episode is not None else None
        others = [s for s in rotation if s is not active.failed_on] or rotation
        if active.server is not None and active.server in others:
            chosen = active.server
        elif sticky is not None and sticky in others:
            chosen = sticky
        else:
            chosen = min(others, key=lambda s: (s.inflight, s.routed))
        if episode is not None:
            self._sticky[episode] = chosen
            self._sticky.move_to_end(episode)
            while len(self._sticky) > self._sticky_capacity:
                self._sticky.popitem(last=False)
        chosen.routed += 1
        return chosen

    def _body(self, active: _Active) -> dict[str, Any]:
        sp = active.request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": active.remaining,
            "temperature": sp.temperature,  # 0 is greedy, in SGLang too
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "min_p": sp.min_p,
            "stop_token_ids": list(sp.stop_token_ids),
            "ignore_eos": sp.ignore_eos,
            "no_stop_trim": True,  # the text holds every token, as the local engine's does
        }
        seed = _resubmission_seed(sp.seed, len(active.tokens))
        if seed is not None and not sp.greedy:
            # SGLang takes int64 seeds: the same 64 bits, read as signed (areal-flow serve
            # reads them back as unsigned, so both servers sample alike)
            params["sampling_seed"] = seed - 2**64 if seed >= 2**63 else seed
        body = {"input_ids": [*active.request.input_ids, *active.tokens],
                "sampling_params": params, "rid": active.wire_rid, "return_logprob": True}
        if self._adapter is not None:
            body["lora_path"] = LORA_NAME  # SGLang resolves an adapter by its name here
        return body

    async def _on_server(self, server: _Server, coro: Coroutine) -> Any:
        """Awaits `coro` as a task of `server`'s, which `_take_out` cancels: that reads here as
        `_ServerDown`; a cancellation of the caller (explicit abort, close) propagates."""
        post = asyncio.ensure_future(coro)
        server.posts.add(post)
        try:
            return await post
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            raise _ServerDown(f"{server.address} was taken out of rotation") from None
        finally:
            server.posts.discard(post)

    async def _post_generate(self, server: _Server, body: dict) -> dict:
        try:
            response = await self._client.post(f"{server.url}/generate", json=body,
                                               timeout=self._generate_timeout)
        except httpx.TransportError as exc:
            raise _ServerDown(f"{server.address}: {exc!r}") from exc
        if response.status_code >= 500:
            raise _ServerError(f"{server.address} answered {response.status_code}: "
                               f"{_error_message(response)}")
        if response.status_code != 200:
            raise GenerationError(f"{server.address} refused the request "
                                  f"({response.status_code}): {_error_message(response)}")
        return response.json()

    def _extend(self, active: _Active, reply: dict, versions: list[int]) -> dict:
        """Append a reply's tokens (made by `versions`) to `active`; returns its finish_reason."""
        meta = reply["meta_info"]
        tokens = list(reply["output_ids"])
        pairs = meta.get("output_token_logprobs") or []
        if [int(p[1]) for p in pairs] != tokens:
            raise GenerationError("'output_token_logprobs' does not match 'output_ids'")
        active.tokens += tokens
        active.logprobs += [float(p[0]) for p in pairs]
        active.versions += versions
        active.texts.append(reply.get("text"))
        if tokens:
            active.failures = active.stalls = 0
        self._counts["generated_tokens"] += len(tokens)
        return meta.get("finish_reason") or {}

    def _completion(self, active: _Active, reason: FinishReason) -> Completion:
        if self._tokenizer is not None:
            text = self._tokenizer.decode(active.tokens, skip_special_tokens=True)
        elif None in active.texts:
            text = None
        else:
            text = "".join(active.texts)
        self._counts["requests"] += 1
        return Completion(token_ids=active.tokens, logprobs=active.logprobs,
                          versions=active.versions, finish_reason=reason,
                          temperature=active.request.sampling.logprob_temperature, text=text)

    async def _abort(self, rid: str | None) -> None:
        targets = list(self._active.values()) if rid is None else [
            a for a in [self._active.get(rid)] if a is not None]
        calls = []
        for active in targets:
            active.cancelled = True
            if active.posted:
                calls.append(self._quietly(self._post(active.server, "/abort_request",
                                                      {"rid": active.wire_rid})))
        await asyncio.gather(*calls)
        async with self._changed:
            self._changed.notify_all()

    # -- pausing and weights ----------------------------------------------------------------

    async def _pause_locked(self) -> None:
        if self._paused:
            return
        self._paused = True
        self._epoch += 1
        await self._on_healthy("/pause_generation", {"mode": "abort"},
                               timeout=self._pause_timeout)

    async def _resume_locked(self) -> None:
        if not self._paused:
            return
        await self._on_healthy("/continue_generation", {}, timeout=self._pause_timeout)
        self._paused = False
        async with self._changed:
            self._changed.notify_all()

    async def _update_weights(self, update: WeightUpdate) -> None:
        async with self._control:
            was_paused = self._paused
            await self._pause_locked()
            try:
                if update.lora is not None:
                    await self._load_adapter(update)
                elif update.path is not None:
                    body = {"model_path": update.path, "weight_version": str(update.version),
                            "abort_all_requests": True, "flush_cache": True}
                    done = await self._on_healthy("/update_weights_from_disk", body, strict=True)
                    if not done:
                        raise WeightUpdateError("no SGLang server was reachable to load "
                                                f"{update.path}")
                    self._caught_up(done)
                    self._disk = (update.path, update.version)
                    self._over_group = False
                else:
                    meta = update.dist_meta
                    members = self._members(meta.group_name)
                    body = {"names": list(meta.names), "dtypes": list(meta.dtypes),
                            "shapes": [list(s) for s in meta.shapes],
                            "group_name": meta.group_name, "abort_all_requests": True,
                            "flush_cache": True}
                    # Only the last bucket names the version: a stale member keeps its own
                    # until then, and the server checks that the buckets completed the model.
                    last = update.version != self._version
                    if last:
                        body["weight_version"] = str(update.version)
                    # every member takes part in the broadcast, so one that is gone is an error
                    await asyncio.gather(*(self._checked(s, "/update_weights_from_distributed",
                                                         body) for s in members))
                    if last:  # every member got every bucket of this version
                        self._caught_up(members, str(update.version))
                    self._over_group = True
                self._version = update.version
            finally:
                if not was_paused:
                    await self._resume_locked()

    async def _load_adapter(self, update: WeightUpdate) -> None:
        """A LoRA adapter folder on every healthy server, as `LORA_NAME` (module docstring)."""
        if update.path is None:
            raise ValueError("the SGLang pool takes a LoRA adapter as a PEFT folder ('path'), "
                             "which its servers load with /load_lora_adapter")
        servers = [s for s in self._servers.values() if s.healthy]
        results = await asyncio.gather(
            *(self._swap_adapter(s, update.path, str(update.version)) for s in servers),
            return_exceptions=True)
        done = []
        for server, result in zip(servers, results):
            if isinstance(result, WeightUpdateError) and not server.healthy:
                continue  # it went down: it catches up when it comes back
            if isinstance(result, BaseException):
                raise result
            done.append(server)
        if not done:
            raise WeightUpdateError(f"no SGLang server was reachable to load {update.path}")
        self._caught_up(done)
        self._adapter = (update.path, update.version)
        self._disk, self._over_group = None, False

    async def _swap_adapter(self, server: _Server, path: str, label: str) -> None:
        """Replace `server`'s adapter: SGLang refuses a second load under a loaded name, so the
        old one goes first (the pool is paused: no request uses it)."""
        response = await self._post(server, "/unload_lora_adapter", {"lora_name": LORA_NAME})
        if response.status_code != 200 and "does not exist" not in _lora_error(response):
            raise WeightUpdateError(f"{server.address}/unload_lora_adapter failed: "
                                    f"{_error_message(response)}")
        await self._checked(server, "/load_lora_adapter",
                            {"lora_name": LORA_NAME, "lora_path": path})
        await self._checked(server, "/update_weight_version",
                            {"new_version": label, "abort_all_requests": True})
        server.label = label

    async def _load_base(self, server: _Server, info: dict) -> None:
        """The base model (`base`) on a server out of rotation, unless it reports the base's
        folder and was never updated (SGLang's ``"default"``); else it is refused, named."""
        if info.get("model_path") == self._base and server.label == "default":
            return
        try:
            await self._load_paused(server, self._base, self._version)
        except WeightUpdateError as exc:
            self._unusable[server.address] = (
                f"SGLang server {server.address} holds {info.get('model_path')!r} at weight "
                f"version {server.label}, not this LoRA run's base model {self._base!r}, and "
                f"could not load it: {exc}")
            raise WeightUpdateError(self._unusable[server.address]) from exc

    async def _load_paused(self, server: _Server, path: str, version: int) -> None:
        """``/update_weights_from_disk`` on a server out of rotation, paused meanwhile: SGLang
        answers 400 to an update it applied when requests still run (the flush after it is
        refused), and a joining server may hold some (sent before it left rotation)."""
        await self._checked(server, "/pause_generation", {"mode": "abort"},
                            timeout=self._pause_timeout)
        try:
            await self._checked(server, "/update_weights_from_disk", {
                "model_path": path, "weight_version": str(version), "abort_all_requests": True,
                "flush_cache": True})
        finally:
            await self._quietly(self._post(server, "/continue_generation", {},
                                           timeout=self._pause_timeout))
        server.label = str(version)

    def _caught_up(self, servers: list[_Server], label: str | None = None) -> None:
        for server in servers:
            if server.stale:
                log.info("SGLang server %s has the latest weights: back in rotation",
                         server.address)
            server.stale = False
            server.label = label or server.label

    def _members(self, group_name: str) -> list[_Server]:
        members = self._groups.get(group_name)
        if members is None:
            raise WeightUpdateError(f"no weight-update group {group_name!r}; call "
                                    "init_weight_group first")
        return members

    async def _begin_session(self, group_name: str) -> None:
        members = self._members(group_name)
        for _ in range(2):
            results = await asyncio.gather(
                *(self._checked(s, "/begin_weight_update", {"selector": "all"}) for s in members),
                return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if not failed:
                return
            # End the session on every member, then try once more: the ones this call opened,
            # one whose answer was lost, and one left open before (a trainer killed between
            # begin and end). SGLang keeps one session per server, whoever opened it, and lets
            # anyone end it; this run holds these servers, so no one else's session is open.
            await asyncio.gather(*(self._quietly(self._checked(s, "/end_weight_update", {}))
                                   for s in members))
        raise failed[0]

    async def _end_session(self, group_name: str) -> None:
        results = await asyncio.gather(  # every member is closed, even when one fails
            *(self._checked(s, "/end_weight_update", {}) for s in self._members(group_name)),
            return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _init_group(self, address: str, port: int, backend: str, group_name: str,
                          world_size: int | None, ranks_per_server: int) -> None:
        # Not under the control lock: joining blocks until the trainer joins too (or times out),
        # and pausing must not wait for that.
        if group_name in self._groups:
            raise WeightUpdateError(f"weight-update group {group_name!r} exists already")
        members = self._answering()
        size = 1 + ranks_per_server * len(members)
        if world_size is not None and world_size != size:
            raise WeightUpdateError(f"the servers changed: {len(members)} answer, but a "
                                    f"group of world size {world_size} was asked for")
        self._groups[group_name] = members
        bodies = [{"master_address": address, "master_port": port,
                   "rank_offset": 1 + i * ranks_per_server, "world_size": size,
                   "group_name": group_name, "backend": backend} for i in range(len(members))]
        try:
            await asyncio.gather(*(self._checked(s, "/init_weights_update_group", body,
                                                 retry=False)
                                   for s, body in zip(members, bodies)))
        except BaseException:
            del self._groups[group_name]
            raise

    async def _destroy_group(self, group_name: str) -> None:
        async with self._control:
            members = self._groups.pop(group_name, [])
            await asyncio.gather(*(self._checked(s, "/destroy_weights_update_group",
                                                 {"group_name": group_name}) for s in members))

    # -- servers ----------------------------------------------------------------------------

    def _rotation(self) -> list[_Server]:
        return [s for s in self._servers.values() if s.in_rotation]

    def _answering(self) -> list[_Server]:
        """Listed and answering: in rotation, or stale (a new weight-update group takes them)."""
        return [s for s in self._servers.values() if s.listed and s.healthy]

    def _take_out(self, server: _Server, reason: object) -> None:
        if server.healthy:
            server.healthy = False
            self._counts["dead_servers"] += 1
            log.warning("SGLang server %s is out of rotation: %s", server.address, reason)
        # its requests continue elsewhere now: one that is frozen would hold them for the whole
        # request timeout (no /abort_request: it would not answer either)
        for post in server.posts:
            post.cancel()

    async def _post(self, server: _Server, path: str, body: dict | None = None, *,
                    method: str = "POST", timeout: httpx.Timeout | None = None,
                    retry: bool = True) -> httpx.Response:
        """One control call; connection errors are retried with backoff (the request was never
        sent, so this is safe for every endpoint)."""
        attempts = self._retries + 1 if retry else 1
        try:
            async for attempt in stamina.retry_context(
                on=httpx.ConnectError, attempts=attempts, timeout=None, wait_initial=0.05,
                wait_max=2.0, wait_jitter=0.05,
            ):
                with attempt:
                    if attempt.num > 1:
                        self._counts["retries"] += 1
                    return await self._client.request(method, f"{server.url}{path}", json=body,
                                                      timeout=timeout or self._control_timeout)
        except httpx.TransportError as exc:
            raise _ServerDown(f"{server.address}{path}: {exc!r}") from exc
        raise AssertionError("unreachable")

    async def _checked(self, server: _Server, path: str, body: dict, **kwargs) -> dict:
        """A control call that must succeed on `server`."""
        try:
            response = await self._post(server, path, body, **kwargs)
        except _ServerDown as exc:
            self._take_out(server, exc)
            raise WeightUpdateError(str(exc)) from exc
        if response.status_code != 200 and not await self._applied(server, body):
            raise WeightUpdateError(f"{server.address}{path} failed ({response.status_code}): "
                                    f"{_error_message(response)}")
        return response.json() if response.content else {}

    async def _applied(self, server: _Server, body: dict) -> bool:
        """After a refused weight update: whether it took effect anyway. SGLang loads the
        weights, then answers 400 when the cache flush after them is refused (a request still
        running); the version it reports tells."""
        version = body.get("weight_version")
        if version is None:
            return False
        try:
            info = await self._post(server, "/model_info", method="GET",
                                    timeout=self._health_timeout)
            return str(info.json().get("weight_version")) == str(version)
        except (_ServerDown, ValueError, AttributeError):
            return False

    async def _on_healthy(self, path: str, body: dict, *, strict: bool = False,
                          timeout: httpx.Timeout | None = None) -> list[_Server]:
        """The same control call on every healthy server at once; a server that does not answer
        (within `timeout`, default the control timeout) is taken out (it catches up when it comes
        back). With `strict`, a refusal is an error. Returns the servers that did it."""
        servers = [s for s in self._servers.values() if s.healthy]
        results = await asyncio.gather(*(self._post(s, path, body, timeout=timeout)
                                         for s in servers), return_exceptions=True)
        done, refused = [], []
        for server, result in zip(servers, results):
            if isinstance(result, _ServerDown):
                self._take_out(server, result)
            elif isinstance(result, BaseException):
                raise result
            elif result.status_code != 200 and not await self._applied(server, body):
                refused.append(f"{server.address}: {_error_message(result)}")
            else:
                done.append(server)
                if "weight_version" in body:
                    server.label = body["weight_version"]
        if refused and strict:
            raise WeightUpdateError(f"{path} failed on {len(refused)} server(s): "
                                    + "; ".join(refused))
        if refused:
            log.warning("%s failed on %d server(s): %s", path, len(refused), "; ".join(refused))
        return done

    async def _quietly(self, coro: Coroutine) -> None:
        try:
            await coro
        except Exception as exc:  # best effort: the request ends with its connection anyway
            log.debug("ignored: %r", exc)

    async def _refresh_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_interval)
            try:
                await self._refresh()
            except Exception:
                log.exception("refreshing the SGLang servers failed")

    async def _renew_periodically(self) -> None:
        """Every third of a lease's time, in a task of its own: the refresh holds the control
        lock through a joining server's catch-up, which lasts as long as loading a model, and
        a lease must not expire meanwhile."""
        while True:
            await asyncio.sleep(self._leases.ttl / 3)
            try:
                self._renew_leases()
            except Exception:
                log.exception("renewing the leases on the SGLang servers failed")

    def _renew_leases(self) -> None:
        """A server whose lease another run took over (this one was not renewed in time) leaves
        rotation, before this run writes into it again."""
        for address in self._leases.renew():
            server = self._servers.get(address)
            log.error("SGLang server %s: this run's lease on it expired and another run took "
                      "it: out of rotation", address)
            if server is not None:
                server.healthy = False

    async def _refresh(self, force: bool = False) -> None:
        """Sync with the addresses file; start liveness checks of servers holding requests; bring
        answering servers (back) into rotation after they catch up with the latest weights.
        Health checks run without the control lock (a server that does not answer must not delay
        a pause); catching up takes it, and waits while paused, since a weight update may be
        under way."""
        async with self._refreshing:
            if self._file is not None:
                self._read_file(force)
            for address, server in list(self._servers.items()):
                if not server.listed and server.inflight == 0:
                    del self._servers[address]
                    if self._leases is not None:
                        self._leases.release(address)
            # SGLang holds /health while generation is paused (503 after ~20 s): not then
            waiting = [] if self._paused else [
                s for s in self._servers.values() if s.listed and not s.healthy]
            for server in [] if self._paused else self._rotation():
                if server.inflight and not server.checking:  # one at a time, not awaited here
                    server.checking = True
                    self._spawn(self._check_alive(server))
            answers = await asyncio.gather(*(self._answers(s) for s in waiting))
            answering = [s for s, ok in zip(waiting, answers) if ok]
            if answering:
                async with self._control:
                    if not self._paused:
                        await asyncio.gather(*(self._admit(s) for s in answering))
            if self._rotation():
                self._available.set()

    def _read_file(self, force: bool) -> None:
        try:
            stat = self._file.stat()
            key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if key == self._file_key and not force:
                return
            lines = self._file.read_text().splitlines()
        except FileNotFoundError:
            return  # being replaced, or not written yet: keep the servers we have
        self._file_key = key
        listed = {line.split("#")[0].strip() for line in lines} - {""}
        for address in listed - set(self._servers):
            self._servers[address] = _Server(address)
            self._counts["servers_joined"] += 1
            log.info("SGLang server %s joins", address)
        for address, server in self._servers.items():
            if server.listed and address not in listed:
                self._counts["servers_left"] += 1
                log.info("SGLang server %s leaves", address)
            server.listed = address in listed

    async def _answers(self, server: _Server) -> bool:
        """Health-checks a server out of rotation (called while the pool is not paused)."""
        try:
            # one that missed our resume (frozen or cut off during a pause) would still be paused,
            # and a paused server holds /health: resume it first (harmless when running)
            await self._post(server, "/continue_generation", {}, retry=False,
                             timeout=self._pause_timeout)
            health = await self._post(server, "/health", method="GET", retry=False,
                                      timeout=self._health_timeout)
        except _ServerDown:
            return False
        return health.status_code == 200

    async def _check_alive(self, server: _Server) -> None:
        """Health-checks a server in rotation that holds requests: nothing else notices one that
        froze while no pause comes (max_staleness 0). One that does not answer within the health
        budget is taken out, which sends its requests elsewhere (`_take_out`); a 5xx answer is
        an answer."""
        epoch = self._epoch
        try:
            await self._post(server, "/health", method="GET", retry=False,
                             timeout=self._health_timeout)
        except _ServerDown as exc:
            if epoch == self._epoch and not self._paused:  # a pause since would hold /health
                self._take_out(server, exc)
        finally:
            server.checking = False

    async def _admit(self, server: _Server) -> None:
        if self._leases is not None:
            try:
                self._leases.acquire(server.address)
            except ServerLeased as exc:
                if self._refused.get(server.address) != str(exc).split(" (for")[0]:
                    log.warning("%s", exc)
                self._refused[server.address] = str(exc).split(" (for")[0]
                return
            self._refused.pop(server.address, None)
        try:
            info = (await self._post(server, "/model_info", method="GET",
                                     timeout=self._health_timeout)).json()
            label = str(info.get("weight_version"))
            if label != server.label:  # restarted, or written by another run, since
                server.known = False
            server.label = label
            if not server.known:
                # a weight-update session left open (a run killed between begin and end)
                # refuses every later begin: anyone may end it (`_begin_session`)
                await self._quietly(self._post(server, "/end_weight_update", {}, retry=False))
            await self._catch_up(server, info)
        except (_ServerDown, WeightUpdateError) as exc:
            log.warning("SGLang server %s is not ready: %s", server.address, exc)
            return
        self._unusable.pop(server.address, None)
        server.known = not server.stale
        server.healthy = True
        if not server.stale:
            log.info("SGLang server %s is in rotation (weights version %s)", server.address,
                     server.label)

    async def _catch_up(self, server: _Server, info: dict) -> None:
        """Give a joining server the latest weights, or mark it stale (module docstring)."""
        current = str(self._version)
        server.stale = False
        if server.known and server.label == current:
            return
        if self._base is not None and not server.known and self._disk is None \
                and not self._over_group:
            await self._load_base(server, info)
        if self._adapter is not None:
            await self._swap_adapter(server, self._adapter[0], str(self._adapter[1]))
        if self._disk is not None and (not server.known or server.label != str(self._disk[1])):
            await self._load_paused(server, *self._disk)
        if server.label == current:
            return
        if self._over_group:
            server.stale = True
            log.warning("SGLang server %s joins after an update over the weight-update group, "
                        "which it was not in: out of rotation until the next update from disk or "
                        "over a new group (it has version %s, the pool %s)", server.address,
                        server.label, current)
            return
        await self._checked(server, "/update_weight_version",  # no update yet: a label only
                            {"new_version": current, "abort_all_requests": True})
        server.label = current


__all__ = ["GenerationError", "SGLangPool", "WeightUpdateError"]

