"""SGLang's HTTP protocol (the part areal_flow uses) in front of the in-process `LocalEngine`.

An SGLang server cannot start on a CPU-only machine, so tests and CPU runs start this one instead
(`areal-flow serve`), and the SGLang generation pool talks to it exactly as to SGLang. Field names,
defaults, status codes and response shapes follow SGLang's ``entrypoints/http_server.py``,
``managers/io_struct.py``, ``sampling/sampling_params.py`` and ``utils/weight_versions.py``
(SGLANG_PROTOCOL.md has the summary). Where this server differs:

- One sequence per ``/generate``; no streaming, no ``text`` prompt, no stop strings, penalties,
  grammars, ``n > 1`` or prompt logprobs. Such a field, or an unknown one, is refused with 400
  naming it, so a client never silently gets other semantics. Errors are SGLang's
  ``{"error": {"message": ...}}`` with status 400.
- Weight versions are integers here (sent as strings), except SGLang's ``"default"`` of a server
  started without ``--weight-version``. ``/update_weights_from_disk`` without
  ``weight_version`` bumps the version by one (SGLang keeps it), so tokens from the new weights
  never carry the old version; ``/update_weights_from_distributed`` without it keeps the version,
  as SGLang does, because a bucketed update names the version on its last bucket only. The call
  that changes the version must complete the model's tensors since the last change (the local
  engine refuses a partial update; SGLang would load it silently).
- ``/update_weights_from_distributed`` runs only inside a weight-update session
  (``/begin_weight_update`` ... ``/end_weight_update``), one at a time, as in SGLang 0.5.23.
- ``/health`` and ``/health_generate`` are SGLang's generation check: after `health_delay`
  (SGLang: 1 s; here 0 by default) one greedy token through the engine, 200; a check that takes
  longer than `health_timeout` (SGLang: 20 s) after that, e.g. held by a pause, answers 503.
- ``meta_info.weight_versions`` is always sent (SGLang's current behaviour): half-open
  ``[start, end)`` spans over the output tokens, one per run of tokens from one version;
  ``weight_version`` is the last span's.
- ``in_place`` pauses like ``retract``: held requests are re-prefilled under the weights loaded
  at ``/continue_generation`` (the engine keeps no KV cache across a pause). There is no prefix
  cache (``cached_tokens`` is 0), but a flush is refused as SGLang refuses it: ``/flush_cache``,
  and the flush after a weight update (``flush_cache``, the default), fail with 400 while a
  request runs or waits, including one just aborted by ``abort_all_requests`` (SGLang aborts
  asynchronously) or held by a retract pause; the update itself is then already applied.
- An empty body is a 400 on every POST route, and ``sampling_seed`` must lie in
  ``[-2**63, 2**63)``, as in SGLang. A weight-update session belongs to the server: anyone may
  end it (a trainer killed between begin and end leaves it open until someone does).
- The weight-update group is joined as SGLang's ``init_custom_process_group`` joins it: a
  process group of its own (never the default one), rendezvous at ``master_address:master_port``
  with the trainer as rank 0, store keys under the group name. The trainer side
  (`areal_flow.runtime.weight_sync`) builds the same group from public torch classes. A server is
  in one group at a time (``/destroy_weights_update_group`` leaves it).
- LoRA (``--enable-lora``): ``/load_lora_adapter`` (a PEFT folder) and ``/unload_lora_adapter``
  as in SGLang, and ``lora_path`` on ``/generate`` names the adapter. One adapter at a time (a
  second load is refused until the first is unloaded), and while one is loaded every request
  must name it (SGLang would serve a request without ``lora_path`` from the base model in the
  same batch; the local engine cannot mix them). Later adapters must have the first one's rank,
  alpha and target modules. Loading keeps the weight version, as in SGLang.
- ``GET /get_load`` is this server's own: the requests in flight with the tokens each has generated
  so far, and the requests held by a pause (tests wait on it instead of sleeping).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import time
import uuid
from typing import Any

import anyio.to_thread
import attrs
import cattrs
import torch
import torch.distributed as dist
from cattrs.v import format_exception
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from areal_flow.inference.local import LocalEngine
from areal_flow.lora import load_adapter
from areal_flow.types import (
    Completion,
    DistributedWeights,
    GenerationRequest,
    SamplingParams,
    WeightUpdate,
)

GREEDY_BELOW = 1e-6
"""SGLang samples greedily when 0 <= temperature < 1e-6."""
HEALTH_CHECK_TIMEOUT_S = 20.0
"""SGLang's ``HEALTH_CHECK_TIMEOUT``: a health check held longer (e.g. by a pause) answers 503."""
DEFAULT_VERSION = -1
"""The engine's version while the server reports SGLang's ``"default"`` (no version given yet)."""
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long joining the weight-update group and each broadcast may take."""
PAUSE_MODES = ("abort", "retract", "in_place")


class BadRequest(ValueError):
    """A body that does not validate; answered 400 ``{"error": {"message": ...}}``."""


# ---------------------------------------------------------------------------- request bodies


def _unsupported(default: Any, *also: Any) -> Any:
    """A field SGLang has and this server does not implement: only its no-op values pass."""

    def check(_: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in (default, *also):
            raise ValueError(
                f"'{attribute.name}' is not supported by this server: {value!r} "
                f"(only {default!r})"
            )

    return attrs.field(default=default, validator=check)


def _version_field(name: str, **kwargs: Any) -> Any:
    """SGLang sends versions as strings; this server's versions are integers >= 0."""

    def convert(value: Any) -> int | None:
        if value is None:
            return None
        text = str(value)
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not (
            text.isascii() and text.isdigit()
        ):
            raise ValueError(f"'{name}' must be a non-negative integer or its string: {value!r}")
        return int(text)

    return attrs.field(converter=convert, **kwargs)


def _one_sequence(value: Any) -> list[int]:
    if isinstance(value, list) and value and all(isinstance(x, list) for x in value):
        raise ValueError("'input_ids' holds a batch; this server takes one sequence per request")
    if not isinstance(value, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise ValueError("'input_ids' must be a list of integer token ids")
    return value


@attrs.frozen(kw_only=True)
class _Sampling:
    """SGLang's ``sampling_params``."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = attrs.field(factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = attrs.field(default=None,
                                            validator=attrs.validators.optional(
                                                [attrs.validators.ge(-2**63),
                                                 attrs.validators.lt(2**63)]))
    """SGLang's range, [-2**63, 2**63) (an int64)."""
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True  # text layout only
    stream_interval: int | None = None  # streaming only
    stop: Any = _unsupported(None, "", [])
    stop_regex: Any = _unsupported(None, "", [])
    n: Any = _unsupported(1)
    frequency_penalty: Any = _unsupported(0.0)
    presence_penalty: Any = _unsupported(0.0)
    repetition_penalty: Any = _unsupported(1.0)
    min_new_tokens: Any = _unsupported(0)
    json_schema: Any = _unsupported(None)
    regex: Any = _unsupported(None)
    ebnf: Any = _unsupported(None)
    structural_tag: Any = _unsupported(None)
    logit_bias: Any = _unsupported(None, {})
    custom_params: Any = _unsupported(None, {})

    def params(self) -> SamplingParams:
        greedy = 0.0 <= self.temperature < GREEDY_BELOW
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            # the engine's seeds are [0, 2**64): the same 64 bits, as a client folds them
            seed=None if self.sampling_seed is None else self.sampling_seed % 2**64,
        )


@attrs.frozen(kw_only=True)
class _Generate:
    input_ids: Any = attrs.field(converter=_one_sequence)  # Any: the converter checks it
    sampling_params: _Sampling = attrs.field(factory=_Sampling)
    rid: str | None = None
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    logprob_start_len: Any = _unsupported(-1)
    top_logprobs_num: Any = _unsupported(0)
    token_ids_logprob: Any = _unsupported(None)
    return_hidden_states: Any = _unsupported(False)
    stream: Any = _unsupported(False)
    text: Any = _unsupported(None)
    lora_path: str | None = None
    """The name of a loaded LoRA adapter (SGLang resolves names, not paths, here)."""


@attrs.frozen(kw_only=True)
class _LoadLora:
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


@attrs.frozen(kw_only=True)
class _UnloadLora:
    lora_name: str
    lora_id: str | None = None


LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@attrs.frozen(kw_only=True)
class _Pause:
    mode: str = attrs.field(default="abort", validator=attrs.validators.in_(PAUSE_MODES))


@attrs.frozen(kw_only=True)
class _Continue:
    torch_empty_cache: bool = True


@attrs.frozen(kw_only=True)
class _Abort:
    rid: str = ""
    abort_all: bool = False


@attrs.frozen(kw_only=True)
class _DiskUpdate:
    model_path: str
    weight_version: Any = _version_field("weight_version", default=None)
    abort_all_requests: bool = False
    flush_cache: bool = True
    keep_pause: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    load_format: Any = _unsupported(None, "auto")
    is_async: Any = _unsupported(False)
    manifest: Any = _unsupported(None)


@attrs.frozen(kw_only=True)
class _VersionUpdate:
    new_version: Any = _version_field("new_version")
    abort_all_requests: bool = True


@attrs.frozen(kw_only=True)
class _BeginUpdate:
    selector: str = attrs.field(default="all",
                                validator=attrs.validators.in_(("target", "draft", "all")))


@attrs.frozen(kw_only=True)
class _EndUpdate:
    pass


@attrs.frozen(kw_only=True)
class _GroupInit:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@attrs.frozen(kw_only=True)
class _DistributedUpdate:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: Any = _version_field("weight_version", default=None)
    abort_all_requests: bool = False
    flush_cache: bool = True
    torch_empty_cache: bool = False
    load_format: Any = _unsupported(None, "auto")


@attrs.frozen(kw_only=True)
class _GroupDestroy:
    group_name: str = "weight_update_group"


def _strict(kind: type, accepted: type | tuple[type, ...]):
    """JSON scalars as they are: true is not 1, "5" is not 5, 2.5 is not 2."""

    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return kind(value)

    return structure


_converter = cattrs.Converter(forbid_extra_keys=True)
for _kind, _accepted in ((int, int), (float, (int, float)), (bool, bool), (str, str)):
    _converter.register_structure_hook(_kind, _strict(_kind, _accepted))


def _describe(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, (ValueError, TypeError)):
        return str(exc)
    return format_exception(exc, type_)


def _without_nulls(data: dict) -> dict:
    """SGLang reads a JSON null as 'use the default'."""
    return {k: _without_nulls(v) if isinstance(v, dict) else v
            for k, v in data.items() if v is not None}


async def _parse(request: Request, cls: type) -> Any:
    raw = await request.body()
    if not raw.strip():  # SGLang's FastAPI routes require a body, even where every field has a default
        raise BadRequest("body: Field required (send a JSON object, {} for the defaults)")
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        data = _without_nulls(data)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    except BadRequest:
        raise
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    try:
        return _converter.structure(data, cls)
    except Exception as exc:  # cattrs gathers every problem with its path
        problems = cattrs.transform_error(exc, path="body", format_exception=_describe)
        raise BadRequest("; ".join(problems)) from None


# ---------------------------------------------------------------------------- responses


_FINISH_REASONS = {
    "stop": lambda c: {"type": "stop", "matched": c.token_ids[-1]},
    "length": lambda c: {"type": "length", "length": len(c.token_ids)},
    "abort": lambda c: {"type": "abort", "message": "Aborted", "status_code": None,
                        "err_type": None},
}


def label(version: int) -> str:
    """A version as SGLang reports it."""
    return "default" if version == DEFAULT_VERSION else str(version)


def version_spans(versions: tuple[int, ...], current: int) -> list[dict[str, Any]]:
    """SGLang's ``weight_versions``: one half-open ``[start, end)`` span of output-token
    positions per run of tokens from one version (a single empty span when there are none)."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(map(label, versions)):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans or [{"version": label(current), "start": 0, "end": 0}]


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra},
                        status_code=200 if success else 400)


# ---------------------------------------------------------------------------- the server


class _Server:
    """Request handlers over one engine. New requests wait at a gate while generation is paused
    (as SGLang's tokenizer manager holds them); control calls that block run in worker threads."""

    def __init__(self, engine: LocalEngine, health_delay: float, health_timeout: float,
                 enable_lora: bool = False):
        self.engine = engine
        self.enable_lora = enable_lora
        self.model_path = engine.model_path
        """The folder of the last update from disk (SGLang's ``model_path``), else the model's."""
        self.loras: dict[str, str] = {}
        """Loaded LoRA adapters, name -> path (one at most here)."""
        self.health_delay = health_delay
        self.health_timeout = health_timeout
        self.stopping = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.held = 0
        """Requests waiting at the gate for `/continue_generation`."""
        self.inflight: set[str] = set()
        self.progress: dict[str, Any] = {}
        """In-flight request id -> the engine's sequence (its tokens so far), for `/get_load`."""
        self.drained = asyncio.Event()
        self.drained.set()
        self.control = asyncio.Lock()
        self.group: str | None = None
        self.group_pg: dist.ProcessGroup | None = None
        self.group_lock = asyncio.Lock()
        self.updating = False
        """A weight-update session is open (``/begin_weight_update``)."""
        self.pause_modes = {"abort": self._abort_and_drain, "retract": self._hold,
                            "in_place": self._hold}

    # -- generation

    async def generate(self, request: Request) -> Response:
        body: _Generate = await _parse(request, _Generate)
        try:
            req = GenerationRequest(input_ids=body.input_ids, rid=body.rid or uuid.uuid4().hex,
                                    sampling=body.sampling_params.params())
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        start = time.perf_counter()
        await self._gate()
        self._check_adapter(body.lora_path)  # after the gate: adapters change while paused
        completion = await self._run(req, request)
        return JSONResponse(self._reply(req, body, completion, time.perf_counter() - start))

    def _check_adapter(self, name: str | None) -> None:
        if name is not None and name not in self.loras:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {{{name!r}}}"
                             f"\nLoaded adapters: {set(self.loras)}.")
        if name is None and self.loras:
            raise BadRequest(f"this server applies its LoRA adapter {next(iter(self.loras))!r} "
                             "to every request: name it in 'lora_path'")

    async def _gate(self) -> None:
        """Wait while generation is paused."""
        self.held += 1
        try:
            while not self.resumed.is_set():
                await self.resumed.wait()
        finally:
            self.held -= 1

    async def _run(self, req: GenerationRequest, request: Request | None = None) -> Completion:
        # Nothing here awaits before `submit`: a pause cannot slip between the gate and the engine.
        if req.rid in self.inflight:
            raise BadRequest(f"duplicate request id ('rid'): {req.rid!r}")
        try:
            seq = self.engine.submit(req)
        except ValueError as exc:  # prompt + max_new_tokens beyond the model's positions
            raise BadRequest(str(exc)) from None
        self.inflight.add(req.rid)
        self.progress[req.rid] = seq
        self.drained.clear()
        watcher = None if request is None else asyncio.create_task(
            self._abort_on_disconnect(request, req.rid))
        try:
            return await asyncio.wrap_future(seq.future)
        except asyncio.CancelledError:
            self.engine.abort(req.rid)
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            self.inflight.discard(req.rid)
            self.progress.pop(req.rid, None)
            if not self.inflight:
                self.drained.set()

    async def _abort_on_disconnect(self, request: Request, rid: str) -> None:
        """The body is read, so the next ASGI message is the client going away."""
        while (await request.receive()).get("type") != "http.disconnect":
            pass
        self.engine.abort(rid)

    def _reply(self, req: GenerationRequest, body: _Generate, c: Completion,
               latency: float) -> dict:
        sp = body.sampling_params
        trim = c.finish_reason == "stop" and not sp.no_stop_trim  # SGLang drops it from the text
        text_ids = c.token_ids[:-1] if trim else c.token_ids
        spans = version_spans(c.versions, self.engine.version)
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": _FINISH_REASONS[c.finish_reason](c),
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": 0,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "e2e_latency": latency,
        }
        if body.return_logprob:
            decode = self.engine.tokenizer.decode
            meta["output_token_logprobs"] = [
                [logprob, token, decode([token]) if body.return_text_in_logprobs else None]
                for logprob, token in zip(c.logprobs, c.token_ids)
            ]
        text = self.engine.tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens)
        return {"text": text, "output_ids": list(c.token_ids), "meta_info": meta}

    # -- health and information

    async def health(self, request: Request) -> Response:
        """``/health`` and ``/health_generate``: one greedy token from ``[0]`` through the engine;
        held while paused; 503 when stopping, or when it takes longer than `health_timeout`."""
        await asyncio.sleep(self.health_delay)
        if self.stopping:
            return Response(status_code=503)
        req = GenerationRequest(input_ids=[0], rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
                                sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            async with asyncio.timeout(self.health_timeout):
                await self._gate()
                await self._run(req)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        config = self.engine.model.config
        return JSONResponse({
            "model_path": self.model_path,
            "tokenizer_path": self.engine.model_path,
            "served_model_name": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": label(self.engine.version),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        })

    async def get_load(self, request: Request) -> Response:
        """Requests in flight (``load``, ``num_reqs``), requests held by a pause
        (``num_waiting_reqs``) and the tokens each in-flight request has generated so far."""
        requests = {rid: len(seq.tokens) for rid, seq in list(self.progress.items())}
        return JSONResponse({"load": len(requests), "num_reqs": len(requests),
                             "num_waiting_reqs": self.held, "requests": requests})

    # -- pausing and aborting

    async def pause_generation(self, request: Request) -> Response:
        body: _Pause = await _parse(request, _Pause)
        async with self.control:
            self.resumed.clear()
            await self.pause_modes[body.mode]()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def _abort_and_drain(self) -> None:
        """Running requests return at once, finish_reason abort, with their tokens so far."""
        self._abort()
        await self.drained.wait()

    async def _hold(self) -> None:
        """Running requests wait in the engine and continue after `/continue_generation`."""
        await anyio.to_thread.run_sync(self.engine.pause)

    async def continue_generation(self, request: Request) -> Response:
        await _parse(request, _Continue)
        async with self.control:
            self.engine.resume()
            self.resumed.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: Request) -> Response:
        body: _Abort = await _parse(request, _Abort)
        self._abort("" if body.abort_all else body.rid)
        return Response(status_code=200)

    def _abort(self, rid: str = "") -> None:
        """Abort every in-flight request whose id starts with `rid` (all for ""), as SGLang
        matches ids by prefix. Done request by request: the engine applies an abort at its next
        step, and an engine-wide one would also hit a request submitted in between."""
        for target in list(self.inflight):
            if target.startswith(rid):
                self.engine.abort(target)

    async def flush_cache(self, request: Request) -> Response:
        if self.inflight:  # SGLang flushes only with no request running or waiting
            return PlainTextResponse(f"Cache not flushed: {len(self.inflight)} request(s) "
                                     "running or waiting.\n", status_code=400)
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n"
        )

    # -- weights

    async def _load(self, update: WeightUpdate, abort_all: bool, flush_cache: bool) -> str | None:
        """Load under the control lock; returns SGLang's error when the cache flush after it is
        refused. SGLang flushes only with no request running or waiting, and aborting is
        asynchronous (``abort_all_requests`` marks requests; they leave at the next step), so a
        request running when the update came, aborted or held by a retract/in-place pause, makes
        the flush fail: a 400 although the weights and version are already loaded."""
        running = len(self.inflight)
        if abort_all:
            self._abort()
        await anyio.to_thread.run_sync(self.engine.update_weights, update)
        if flush_cache and running:
            return (f"Cache flush failed after updating weights: {running} request(s) running "
                    f"or waiting (the weights of version {label(update.version)} are loaded)")
        return None

    async def update_weights_from_disk(self, request: Request) -> Response:
        body: _DiskUpdate = await _parse(request, _DiskUpdate)
        async with self.control:
            version = body.weight_version
            version = self.engine.version + 1 if version is None else version
            paused = 0 if body.abort_all_requests else len(self.inflight)
            try:
                refused = await self._load(WeightUpdate(version=version, path=body.model_path),
                                           body.abort_all_requests, body.flush_cache)
            except Exception as exc:
                return _result(False, f"Failed to update weights: {exc}", num_paused_requests=0)
            if refused:
                return _result(False, refused, num_paused_requests=paused)
            self.model_path = body.model_path  # /model_info reports it, as SGLang's does
        return _result(True, f"Succeeded to update model weights. Weight version updated to "
                             f"{version}.", num_paused_requests=paused)

    async def update_weight_version(self, request: Request) -> Response:
        body: _VersionUpdate = await _parse(request, _VersionUpdate)
        async with self.control:
            if body.abort_all_requests:
                self._abort()
            self.engine.set_version(body.new_version)
        return JSONResponse({"success": True, "message": f"Weight version updated to "
                             f"{body.new_version}", "new_version": str(body.new_version)})

    async def load_lora_adapter(self, request: Request) -> Response:
        body: _LoadLora = await _parse(request, _LoadLora)
        async with self.control:
            if not self.enable_lora:
                return self._lora_result(LORA_DISABLED)
            if body.lora_name in self.loras:
                return self._lora_result(f"Failed to load LoRA adapter {body.lora_name} because "
                                         "it is already loaded")
            if self.loras:
                return self._lora_result(
                    f"Failed to load LoRA adapter {body.lora_name}: this server holds one adapter "
                    f"at a time and {next(iter(self.loras))!r} is loaded; unload it first")
            try:
                await anyio.to_thread.run_sync(_load_adapter, self.engine, body.lora_path)
            except Exception as exc:
                return self._lora_result(f"Failed to load LoRA adapter {body.lora_name}: {exc}")
            self.loras[body.lora_name] = body.lora_path
        return self._lora_result(None)

    async def unload_lora_adapter(self, request: Request) -> Response:
        body: _UnloadLora = await _parse(request, _UnloadLora)
        async with self.control:
            if not self.enable_lora:
                return self._lora_result(LORA_DISABLED)
            if body.lora_name not in self.loras:
                return self._lora_result(f"LoRA with name {body.lora_name} does not exist. "
                                         f"Loaded LoRAs: {set(self.loras)}")
            # as SGLang: no new request may use it, then the running ones finish first
            del self.loras[body.lora_name]
            await self.drained.wait()
            await anyio.to_thread.run_sync(self.engine.remove_adapter)
        return self._lora_result(None)

    def _lora_result(self, error: str | None) -> JSONResponse:
        return JSONResponse({"success": error is None, "error_message": error,
                             "loaded_adapters": dict(self.loras)},
                            status_code=200 if error is None else 400)

    async def begin_weight_update(self, request: Request) -> Response:
        await _parse(request, _BeginUpdate)
        if self.updating:
            return _result(False, "begin_weight_update called while a weight-update session is "
                                  "already open")
        self.updating = True
        return _result(True, "Success")

    async def end_weight_update(self, request: Request) -> Response:
        await _parse(request, _EndUpdate)
        if not self.updating:
            return _result(False, "end_weight_update called without begin_weight_update")
        self.updating = False
        return _result(True, "Success")

    async def init_weights_update_group(self, request: Request) -> Response:
        body: _GroupInit = await _parse(request, _GroupInit)
        async with self.group_lock:  # blocks until every rank joins, so not the control lock
            if self.group is not None:
                return _result(False, f"already in weight update group {self.group!r}")
            try:
                self.group_pg = await anyio.to_thread.run_sync(_join_group, body)
            except Exception as exc:
                return _result(False, f"Failed to initialize custom process group: {exc}")
            self.group = body.group_name
        return _result(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, request: Request) -> Response:
        body: _DistributedUpdate = await _parse(request, _DistributedUpdate)
        try:
            meta = DistributedWeights(names=body.names, dtypes=body.dtypes, shapes=body.shapes,
                                      group_name=body.group_name)
            dtypes = [_torch_dtype(d) for d in meta.dtypes]
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if not self.updating:
            return _result(False, "update_weights_from_distributed must run between "
                                  "begin_weight_update() and end_weight_update()")
        async with self.group_lock:
            if self.group != meta.group_name:
                return _result(False, f"not in weight update group {meta.group_name!r}; call "
                                      "/init_weights_update_group first")
            receive = functools.partial(_receive, self.group_pg, meta, dtypes, self.engine.device)
            try:
                tensors = await anyio.to_thread.run_sync(receive)
            except Exception as exc:
                return _result(False, f"Failed to receive weights: {exc}")
        async with self.control:
            version = self.engine.version if body.weight_version is None else body.weight_version
            try:
                refused = await self._load(WeightUpdate(version=version, state_dict=tensors),
                                           body.abort_all_requests, body.flush_cache)
            except Exception as exc:
                return _result(False, f"Failed to update parameter online: {exc}")
            if refused:
                return _result(False, refused)
        return _result(True, "Succeeded to update parameter online. Weight version is "
                             f"{label(version)}.")

    async def destroy_weights_update_group(self, request: Request) -> Response:
        body: _GroupDestroy = await _parse(request, _GroupDestroy)
        async with self.group_lock:
            if self.group != body.group_name:
                return _result(False, f"not in weight update group {body.group_name!r}")
            self._leave_group()
        return _result(True, "Succeeded to destroy custom process group.")

    def _leave_group(self) -> None:
        dist.destroy_process_group(self.group_pg)
        self.group, self.group_pg = None, None

    def close(self) -> None:
        self.stopping = True
        if self.group is not None:
            self._leave_group()


def _load_adapter(engine: LocalEngine, path: str) -> None:
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


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"'dtypes' holds an unknown torch dtype: {name!r}")
    return dtype


def _join_group(body: _GroupInit) -> dist.ProcessGroup:
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


def _receive(group: dist.ProcessGroup, meta: DistributedWeights, dtypes: list[torch.dtype],
             device: torch.device) -> dict:
    """The trainer (rank 0 of the group) broadcasts the tensors in the order of `meta.names`."""
    tensors = {}
    for name, dtype, shape in zip(meta.names, dtypes, meta.shapes):
        tensors[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensors[name], src=0, group=group)
    return tensors


async def _bad_request(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": {"message": str(exc)}}, status_code=400)


def build_app(engine: LocalEngine, *, health_delay: float = 0.0,
              health_timeout: float = HEALTH_CHECK_TIMEOUT_S,
              enable_lora: bool = False) -> Starlette:
    """The HTTP app over `engine` (the caller owns and closes the engine; ``app.state.server``
    holds the handlers). A health check waits `health_delay` seconds first (SGLang: 1 s), then
    answers 503 if its one-token generation (held by a pause, say) takes over `health_timeout`."""
    s = _Server(engine, health_delay, health_timeout, enable_lora)
    post, get = ["POST"], ["GET"]
    routes = [
        Route("/generate", s.generate, methods=["POST", "PUT"]),
        Route("/health", s.health, methods=get),
        Route("/health_generate", s.health, methods=get),
        Route("/model_info", s.model_info, methods=get),
        Route("/get_model_info", s.model_info, methods=get),  # SGLang's deprecated alias
        Route("/get_load", s.get_load, methods=get),
        Route("/pause_generation", s.pause_generation, methods=post),
        Route("/continue_generation", s.continue_generation, methods=post),
        Route("/abort_request", s.abort_request, methods=post),
        Route("/flush_cache", s.flush_cache, methods=["GET", "POST"]),
        Route("/update_weights_from_disk", s.update_weights_from_disk, methods=post),
        Route("/update_weight_version", s.update_weight_version, methods=post),
        Route("/load_lora_adapter", s.load_lora_adapter, methods=post),
        Route("/unload_lora_adapter", s.unload_lora_adapter, methods=post),
        Route("/begin_weight_update", s.begin_weight_update, methods=post),
        Route("/end_weight_update", s.end_weight_update, methods=post),
        Route("/init_weights_update_group", s.init_weights_update_group, methods=post),
        Route("/update_weights_from_distributed", s.update_weights_from_distributed, methods=post),
        Route("/destroy_weights_update_group", s.destroy_weights_update_group, methods=post),
    ]
    app = Starlette(routes=routes, exception_handlers={BadRequest: _bad_request})
    app.state.server = s
    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, *,
          weight_version: int | None = None, health_delay: float = 0.0,
          health_timeout: float = HEALTH_CHECK_TIMEOUT_S, enable_lora: bool = False,
          **engine_kwargs: Any) -> None:
    """Load `model` into a `LocalEngine` and serve it until interrupted (SGLang's default port).
    Without `weight_version` the server reports ``"default"``, as SGLang does."""
    import uvicorn

    version = DEFAULT_VERSION if weight_version is None else weight_version
    engine = LocalEngine(model, version=version, **engine_kwargs)
    app = build_app(engine, health_delay=health_delay, health_timeout=health_timeout,
                    enable_lora=enable_lora)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        app.state.server.close()
        engine.close()
