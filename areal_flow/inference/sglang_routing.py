"""The SGLang pool's requests: routing, resubmission, and joining replies into one `Completion`.

Requests go to the least-loaded server in rotation, staying on their `episode_id`'s (its prefix
cache holds earlier turns). `pause` aborts running requests; the pool keeps their tokens and, on
`resume`, resubmits prompt + tokens so far (a seeded one with a seed derived from both, so it
never replays the first draws): callers never see the abort. A dead server, or one that restarted
(weight version ``"default"``), is taken out and its requests resume elsewhere. Each attempt's id
is ``<32 hex>-<rid>``: ``/abort_request`` aborts every id it prefixes; none may prefix another."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, get_args

import attrs
import httpx

from areal_flow.inference.sglang_servers import Server, ServerDown, ServerError, error_message
from areal_flow.inference.sglang_weights import LORA_NAME
from areal_flow.types import Completion, FinishReason, GenerationRequest, derived_seed

log = logging.getLogger(__name__)



class GenerationError(RuntimeError):
    """A request failed for good: refused by a server, or resubmitted too often in vain."""



@attrs.define(eq=False)
class Active:
    """A `generate` call while the pool holds it: everything received so far."""

    request: GenerationRequest
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    texts: list[str | None] = attrs.field(factory=list)
    server: Server | None = None
    failed_on: Server | None = None
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
        raise ServerDown(f"it reports weight version {label!r}, not the pool's label") from None


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



class Routing:

    async def _generate(self, request: GenerationRequest) -> Completion:
        if request.rid in self._active:
            raise ValueError(f"request id {request.rid!r} is already being generated")
        active = self._active[request.rid] = Active(request)
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

    async def _complete(self, active: Active) -> Completion:
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
                reply = await self._post_generate(server, self._body(active))
                versions = _token_versions(reply["meta_info"], len(reply["output_ids"]))
                if versions and min(versions) < sent_at:  # never, when joining servers catch up
                    self._counts["behind_replies"] += 1
            except (ServerDown, ServerError) as exc:
                if isinstance(exc, ServerDown):
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
                    self._spawn(self._abort_attempt(server, active.wire_rid))
                raise
            finally:
                server.inflight -= 1
                active.posted = False

            finish = self._extend(active, reply, versions)
            reason = finish.get("type")
            if reason not in get_args(FinishReason):
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

    async def _route(self, active: Active) -> Server:
        """The server for the next attempt: the previous one, else the episode's, else the least
        loaded; after a 5xx, any other server before the one that gave it."""
        try:
            async with asyncio.timeout(self._no_server_timeout):
                while not (rotation := self._rotation()):
                    self._available.clear()
                    await self._available.wait()
        except TimeoutError:
            raise GenerationError(f"no SGLang server in rotation for {self._no_server_timeout} s; "
                                  f"known: {sorted(self._servers)}") from None
        episode = active.request.episode_id
        others = [s for s in rotation if s is not active.failed_on] or rotation
        if active.server in others:
            chosen = active.server
        elif (sticky := self._sticky.get(episode)) in others:  # None is never a key
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

    async def _abort_attempt(self, server: Server, wire_rid: str) -> None:
        await self._quietly(self._post(server, "/abort_request", {"rid": wire_rid}))

    def _body(self, active: Active) -> dict[str, Any]:
        sp = active.request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": active.remaining,
            "temperature": sp.temperature,  # 0 is greedy, in SGLang too
            "top_p": sp.top_p, "top_k": sp.top_k, "min_p": sp.min_p,
            "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos,
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

    async def _post_generate(self, server: Server, body: dict) -> dict:
        """``/generate`` as a task `_take_out` may cancel (then `ServerDown`; ours propagates)."""
        post = asyncio.ensure_future(self._client.post(f"{server.url}/generate", json=body,
                                                       timeout=self._generate_timeout))
        server.posts.add(post)
        try:
            response = await post
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            raise ServerDown(f"{server.address} was taken out of rotation") from None
        except httpx.TransportError as exc:
            raise ServerDown(f"{server.address}: {exc!r}") from exc
        finally:
            server.posts.discard(post)
        if response.status_code >= 500:
            raise ServerError(f"{server.address} answered {response.status_code}: "
                               f"{error_message(response)}")
        if response.status_code != 200:
            raise GenerationError(f"{server.address} refused the request "
                                  f"({response.status_code}): {error_message(response)}")
        return response.json()

    def _extend(self, active: Active, reply: dict, versions: list[int]) -> dict:
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

    def _completion(self, active: Active, reason: FinishReason) -> Completion:
        text = None if None in active.texts else "".join(active.texts)
        if self._tokenizer is not None:
            text = self._tokenizer.decode(active.tokens, skip_special_tokens=True)
        self._counts["requests"] += 1
        return Completion(token_ids=active.tokens, logprobs=active.logprobs,
                          versions=active.versions, finish_reason=reason,
                          temperature=active.request.sampling.logprob_temperature, text=text)

    async def _abort(self, rid: str | None) -> None:
        targets = [a for r, a in self._active.items() if rid is None or r == rid]
        for active in targets:
            active.cancelled = True
        await asyncio.gather(*(self._abort_attempt(a.server, a.wire_rid)
                               for a in targets if a.posted))
        async with self._changed:
            self._changed.notify_all()
