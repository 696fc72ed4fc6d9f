"""The server's request handlers over one `LocalEngine`, and the Starlette app that routes
SGLang's paths to them (`build_app`, `serve`)."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

import anyio.to_thread
import torch.distributed as dist
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from areal_flow.inference.local import LocalEngine
from areal_flow.protocol_server.requests import (
    DEFAULT_VERSION, HEALTH_CHECK_TIMEOUT_S, LORA_DISABLED, Abort, BadRequest, BeginUpdate,
    Continue, DiskUpdate, DistributedUpdate, EndUpdate, Generate, GroupDestroy, GroupInit,
    LoadLora, Pause, UnloadLora, VersionUpdate, parse)
from areal_flow.protocol_server.weight_group import (join_group, load_adapter_keeping_version,
                                                     receive, torch_dtype)
from areal_flow.types import (Completion, DistributedWeights, GenerationRequest,
                              SamplingParams, WeightUpdate)


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
        body: Generate = await parse(request, Generate)
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

    def _reply(self, req: GenerationRequest, body: Generate, c: Completion,
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
        body: Pause = await parse(request, Pause)
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
        await parse(request, Continue)
        async with self.control:
            self.engine.resume()
            self.resumed.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: Request) -> Response:
        body: Abort = await parse(request, Abort)
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
        body: DiskUpdate = await parse(request, DiskUpdate)
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
        body: VersionUpdate = await parse(request, VersionUpdate)
        async with self.control:
            if body.abort_all_requests:
                self._abort()
            self.engine.set_version(body.new_version)
        return JSONResponse({"success": True, "message": f"Weight version updated to "
                             f"{body.new_version}", "new_version": str(body.new_version)})

    async def load_lora_adapter(self, request: Request) -> Response:
        body: LoadLora = await parse(request, LoadLora)
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
                await anyio.to_thread.run_sync(load_adapter_keeping_version, self.engine, body.lora_path)
            except Exception as exc:
                return self._lora_result(f"Failed to load LoRA adapter {body.lora_name}: {exc}")
            self.loras[body.lora_name] = body.lora_path
        return self._lora_result(None)

    async def unload_lora_adapter(self, request: Request) -> Response:
        body: UnloadLora = await parse(request, UnloadLora)
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
        await parse(request, BeginUpdate)
        if self.updating:
            return _result(False, "begin_weight_update called while a weight-update session is "
                                  "already open")
        self.updating = True
        return _result(True, "Success")

    async def end_weight_update(self, request: Request) -> Response:
        await parse(request, EndUpdate)
        if not self.updating:
            return _result(False, "end_weight_update called without begin_weight_update")
        self.updating = False
        return _result(True, "Success")

    async def init_weights_update_group(self, request: Request) -> Response:
        body: GroupInit = await parse(request, GroupInit)
        async with self.group_lock:  # blocks until every rank joins, so not the control lock
            if self.group is not None:
                return _result(False, f"already in weight update group {self.group!r}")
            try:
                self.group_pg = await anyio.to_thread.run_sync(join_group, body)
            except Exception as exc:
                return _result(False, f"Failed to initialize custom process group: {exc}")
            self.group = body.group_name
        return _result(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, request: Request) -> Response:
        body: DistributedUpdate = await parse(request, DistributedUpdate)
        try:
            meta = DistributedWeights(names=body.names, dtypes=body.dtypes, shapes=body.shapes,
                                      group_name=body.group_name)
            dtypes = [torch_dtype(d) for d in meta.dtypes]
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if not self.updating:
            return _result(False, "update_weights_from_distributed must run between "
                                  "begin_weight_update() and end_weight_update()")
        async with self.group_lock:
            if self.group != meta.group_name:
                return _result(False, f"not in weight update group {meta.group_name!r}; call "
                                      "/init_weights_update_group first")
            broadcast = functools.partial(receive, self.group_pg, meta, dtypes, self.engine.device)
            try:
                tensors = await anyio.to_thread.run_sync(broadcast)
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
        body: GroupDestroy = await parse(request, GroupDestroy)
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
