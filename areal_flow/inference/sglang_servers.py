"""The SGLang pool's servers: membership, health, leases, and the control calls to them.

A server that joins (the addresses file is re-read when it changes) or comes back first gets the
latest weights, never while paused; if they came over a weight-update group, it stays *stale*,
out of rotation, until an update reaches it whole. A new server is sent ``/end_weight_update``
first: a run killed between begin and end leaves a session that refuses every later begin. Leases
(`launch/lease.py`) keep two runs from writing into one server. Control calls retry connection
errors with backoff (the request was never sent, so this is safe for every endpoint)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine

import attrs
import httpx
import stamina

log = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """A server refused a weight update or a weight-update group call."""



class ServerDown(Exception):
    """The server did not answer (connection refused/reset, timeout)."""



class ServerError(Exception):
    """The server answered 5xx: it is alive; the request is retried elsewhere where possible."""



@attrs.define(eq=False)
class Server:
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
    known: bool = False
    """This pool caught it up and it still reports that label: its weights are this run's."""

    @property
    def url(self) -> str:
        return self.address if "://" in self.address else f"http://{self.address}"

    @property
    def in_rotation(self) -> bool:
        return self.listed and self.healthy and not self.stale



def error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):  # LoRA replies name it error_message (LoRAUpdateOutput)
        body = body.get("error_message") or body.get("error", body)
    return str(body.get("message", body) if isinstance(body, dict) else body)


def lora_error(response: httpx.Response) -> str:
    """SGLang's LoRA error (``error_message``), never matched in the printed reply."""
    try:
        return str(response.json().get("error_message") or "")
    except (ValueError, AttributeError):
        return ""



class Servers:

    def _rotation(self) -> list[Server]:
        return [s for s in self._servers.values() if s.in_rotation]

    def _answering(self) -> list[Server]:
        """Listed and answering: in rotation, or stale (a new weight-update group takes them)."""
        return [s for s in self._servers.values() if s.listed and s.healthy]

    def _take_out(self, server: Server, reason: object) -> None:
        if server.healthy:
            server.healthy = False
            self._counts["dead_servers"] += 1
            log.warning("SGLang server %s is out of rotation: %s", server.address, reason)
        # its requests continue elsewhere now: one that is frozen would hold them for the whole
        # request timeout (no /abort_request: it would not answer either)
        for post in server.posts:
            post.cancel()

    async def _post(self, server: Server, path: str, body: dict | None = None, *,
                    method: str = "POST", timeout: httpx.Timeout | None = None,
                    retry: bool = True) -> httpx.Response:
        """One control call, retrying connection errors; a GET within the health budget."""
        attempts = self._retries + 1 if retry else 1
        default = self._health_timeout if method == "GET" else self._control_timeout
        try:
            async for attempt in stamina.retry_context(
                on=httpx.ConnectError, attempts=attempts, timeout=None, wait_initial=0.05,
                wait_max=2.0, wait_jitter=0.05,
            ):
                with attempt:
                    if attempt.num > 1:
                        self._counts["retries"] += 1
                    return await self._client.request(method, f"{server.url}{path}", json=body,
                                                      timeout=timeout or default)
        except httpx.TransportError as exc:
            raise ServerDown(f"{server.address}{path}: {exc!r}") from exc

    async def _checked(self, server: Server, path: str, body: dict, **kwargs) -> None:
        """A control call that must succeed on `server`."""
        try:
            response = await self._post(server, path, body, **kwargs)
        except ServerDown as exc:
            self._take_out(server, exc)
            raise WeightUpdateError(str(exc)) from exc
        if response.status_code != 200 and not await self._applied(server, body):
            raise WeightUpdateError(f"{server.address}{path} failed ({response.status_code}): "
                                    f"{error_message(response)}")

    async def _applied(self, server: Server, body: dict) -> bool:
        """After a refused weight update, whether it applied anyway (SGLang loads, then answers
        400 when a running request blocks the cache flush), by the version the server reports."""
        version = body.get("weight_version")
        if version is None:
            return False
        try:
            info = await self._post(server, "/model_info", method="GET")
            return str(info.json().get("weight_version")) == str(version)
        except (ServerDown, ValueError, AttributeError):
            return False

    async def _on_healthy(self, path: str, body: dict, *, strict: bool = False,
                          timeout: httpx.Timeout | None = None) -> list[Server]:
        """The same control call on every healthy server at once; one that does not answer is
        taken out, a refusal is an error with `strict`. Returns the servers that did it."""
        servers = [s for s in self._servers.values() if s.healthy]
        results = await asyncio.gather(*(self._post(s, path, body, timeout=timeout)
                                         for s in servers), return_exceptions=True)
        done, refused = [], []
        for server, result in zip(servers, results):
            if isinstance(result, ServerDown):
                self._take_out(server, result)
            elif isinstance(result, BaseException):
                raise result
            elif result.status_code != 200 and not await self._applied(server, body):
                refused.append(f"{server.address}: {error_message(result)}")
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

    async def _every(self, seconds: float, fn: Callable[[], Awaitable], doing: str) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await fn()
            except Exception:
                log.exception("%s the SGLang servers failed", doing)

    async def _renew_leases(self) -> None:
        """A server whose lease another run took over leaves rotation before we write into it."""
        for address in self._leases.renew():
            log.error("SGLang server %s: this run's lease on it expired and another run took "
                      "it: out of rotation", address)
            if address in self._servers:
                self._servers[address].healthy = False

    async def _refresh(self, force: bool = False) -> None:
        """Sync with the addresses file, start liveness checks, and admit answering servers once
        caught up. Health checks skip the control lock: a silent server must not delay a pause."""
        async with self._refreshing:
            if self._file is not None:
                self._read_file(force)
            for address, server in list(self._servers.items()):
                if not server.listed and server.inflight == 0:
                    del self._servers[address]
                    if self._leases is not None:
                        self._leases.release(address)
            # SGLang holds /health while generation is paused (503 after ~20 s): not then
            if not self._paused:
                for server in self._rotation():
                    if server.inflight and not server.checking:  # one at a time, not awaited
                        server.checking = True
                        self._spawn(self._check_alive(server))
                waiting = [s for s in self._servers.values() if s.listed and not s.healthy]
                answers = await asyncio.gather(*(self._answers(s) for s in waiting))
                if answering := [s for s, ok in zip(waiting, answers) if ok]:
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
            self._servers[address] = Server(address)
            self._counts["servers_joined"] += 1
            log.info("SGLang server %s joins", address)
        for address, server in self._servers.items():
            if server.listed and address not in listed:
                self._counts["servers_left"] += 1
                log.info("SGLang server %s leaves", address)
            server.listed = address in listed

    async def _answers(self, server: Server) -> bool:
        """Health-checks a server out of rotation (called while the pool is not paused)."""
        try:
            # one that missed our resume (frozen or cut off during a pause) would still be paused,
            # and a paused server holds /health: resume it first (harmless when running)
            await self._post(server, "/continue_generation", {}, retry=False,
                             timeout=self._pause_timeout)
            health = await self._post(server, "/health", method="GET", retry=False)
        except ServerDown:
            return False
        return health.status_code == 200

    async def _check_alive(self, server: Server) -> None:
        """Health-check a server in rotation that holds requests (nothing else notices one frozen
        while no pause comes): silence within the health budget takes it out; a 5xx answers."""
        epoch = self._epoch
        try:
            await self._post(server, "/health", method="GET", retry=False)
        except ServerDown as exc:
            if epoch == self._epoch and not self._paused:  # a pause since would hold /health
                self._take_out(server, exc)
        finally:
            server.checking = False

    async def _admit(self, server: Server) -> None:
        if self._leases is not None:
            from areal_flow.launch.lease import ServerLeased

            try:
                self._leases.acquire(server.address)
            except ServerLeased as exc:
                if self._refused.get(server.address) != (reason := str(exc).split(" (for")[0]):
                    log.warning("%s", exc)
                    self._refused[server.address] = reason
                return
            self._refused.pop(server.address, None)
        try:
            info = (await self._post(server, "/model_info", method="GET")).json()
            label = str(info.get("weight_version"))
            if label != server.label:  # restarted, or written by another run, since
                server.known = False
            server.label = label
            if not server.known:
                # a weight-update session left open (a run killed between begin and end)
                # refuses every later begin: anyone may end it (`_begin_session`)
                await self._quietly(self._post(server, "/end_weight_update", {}, retry=False))
            await self._catch_up(server, info)
        except (ServerDown, WeightUpdateError) as exc:
            log.warning("SGLang server %s is not ready: %s", server.address, exc)
            return
        self._unusable.pop(server.address, None)
        server.known = not server.stale
        server.healthy = True
        if not server.stale:
            log.info("SGLang server %s is in rotation (weights version %s)", server.address,
                     server.label)
