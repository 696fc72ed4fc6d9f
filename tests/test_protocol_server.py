"""The SGLang-protocol server over the local engine: every endpoint, over real HTTP.

Most tests share one in-process server (uvicorn in a thread, so the tests can reach the engine and
the server's state); the last two start the real `areal-flow serve` command. Pauses are made
deterministic with the engine's `on_step` hook, which pauses the engine from its own thread at a
chosen step; nothing waits on a fixed sleep.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch
import uvicorn

from areal_flow.inference.local import LocalEngine
from areal_flow.protocol_server.app import build_app
from areal_flow.types import GenerationRequest, SamplingParams

PROMPT_TEXT = "Question: what is 12 + 30? Answer:"
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy_reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs (T = 1) from full forwards, no KV cache."""
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids.append(token)
    return tokens, logprobs


def perturbed_model(model_dir, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, max_batch_size=8)
    app = build_app(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: uv.started, what="uvicorn to start")
    client = httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=60)
    yield SimpleNamespace(client=client, engine=engine, state=app.state.server,
                          prompt=engine.tokenizer.encode(PROMPT_TEXT))
    client.close()
    uv.should_exit = True
    thread.join(timeout=30)
    engine.close()


@pytest.fixture
def hook(server):
    """Install an `on_step` hook for one test; afterwards the server is running again."""
    yield lambda fn: setattr(server.engine, "on_step", fn)
    server.engine.on_step = None
    server.client.post("/continue_generation", json={})


@pytest.fixture(scope="module")
def perturbed_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("perturbed")
    perturbed_model(tiny_model_dir, seed=1).save_pretrained(path)
    return path


def freeze_after(state, requests: int, steps: int, fired: threading.Event):
    """An `on_step` hook that pauses the engine (from its own thread, so at an exact step) at the
    `steps`-th step during which the server holds `requests` requests; a request submitted during
    a step is admitted at the next one, so steps >= 2 means all of them have tokens."""
    seen = 0

    def on_step(engine: LocalEngine) -> None:
        nonlocal seen
        if fired.is_set() or len(state.inflight) < requests:
            return
        seen += 1
        if seen >= steps:
            engine.pause(wait=False)
            fired.set()

    return on_step


def post_generate(server, ids, rid=None, **sampling) -> httpx.Response:
    body = {"input_ids": list(ids), "sampling_params": sampling, "return_logprob": True}
    if rid is not None:
        body["rid"] = rid
    return server.client.post("/generate", json=body)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def engine_greedy(server, ids, n: int):
    sampling = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(input_ids=ids, sampling=sampling)
    return server.engine.submit(request).future.result(60)


# ---------------------------------------------------------------------------- /generate


def test_greedy_generate_equals_the_engine_in_sglang_shapes(server):
    expected = engine_greedy(server, server.prompt, 12)
    out = ok(post_generate(server, server.prompt, rid="greedy-1", max_new_tokens=12,
                           temperature=0, ignore_eos=True))
    ids = list(expected.token_ids)
    assert out["output_ids"] == ids
    assert out["text"] == server.engine.tokenizer.decode(ids, skip_special_tokens=True)
    meta = out["meta_info"]
    version = str(server.engine.version)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(expected.logprobs,
                                                                                  abs=1e-5)
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert meta["id"] == "greedy-1"
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (
        len(server.prompt), 12, 0)
    assert meta["weight_version"] == version
    assert meta["weight_versions"] == [{"version": version, "start": 0, "end": 12}]
    assert meta["e2e_latency"] > 0

    # a temperature below 1e-6 is greedy (as in SGLang); logprobs only when asked, text on request
    body = {"input_ids": server.prompt, "return_text_in_logprobs": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1e-7, "ignore_eos": True}}
    again = ok(server.client.post("/generate", json=body))
    assert again["output_ids"] == ids
    assert [text for _, _, text in again["meta_info"]["output_token_logprobs"]] == [
        server.engine.tokenizer.decode([t]) for t in ids]
    plain = ok(server.client.post("/generate", json={"input_ids": server.prompt}))
    assert "output_token_logprobs" not in plain["meta_info"]
    assert plain["meta_info"]["id"]  # a rid is made up when none is given


def test_finish_reason_stop_and_length(server):
    full = list(engine_greedy(server, server.prompt, 10).token_ids)
    stop = full[4]
    cut = full[: full.index(stop) + 1]
    out = ok(post_generate(server, server.prompt, max_new_tokens=10, temperature=0,
                           ignore_eos=True, stop_token_ids=[stop]))
    assert out["output_ids"] == cut
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    decode = server.engine.tokenizer.decode
    assert out["text"] == decode(cut[:-1], skip_special_tokens=True)  # the stop token is trimmed
    kept = ok(post_generate(server, server.prompt, max_new_tokens=10, temperature=0,
                            ignore_eos=True, stop_token_ids=[stop], no_stop_trim=True))
    assert kept["text"] == decode(cut, skip_special_tokens=True)
    short = ok(post_generate(server, server.prompt, max_new_tokens=3, temperature=0,
                             ignore_eos=True))
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert short["output_ids"] == full[:3]


def test_sampling_seed_makes_sampled_generations_repeatable(server):
    kwargs = dict(max_new_tokens=16, temperature=1.0, top_k=50, ignore_eos=True)
    a, b = (ok(post_generate(server, server.prompt, sampling_seed=5, **kwargs)) for _ in range(2))
    c = ok(post_generate(server, server.prompt, sampling_seed=6, **kwargs))
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]
    assert len(a["meta_info"]["output_token_logprobs"]) == 16
    # SGLang's seeds are int64: a negative one is the engine's unsigned seed of the same bits
    folded = ok(post_generate(server, server.prompt, sampling_seed=-1, **kwargs))
    request = GenerationRequest(input_ids=server.prompt, sampling=SamplingParams(
        seed=2**64 - 1, **kwargs))
    assert folded["output_ids"] == list(server.engine.submit(request).future.result(60).token_ids)


@pytest.mark.faults
def test_a_bad_request_never_fails_the_requests_running_beside_it(server, hook):
    expected = list(engine_greedy(server, server.prompt, 20).token_ids)
    fired = threading.Event()
    hook(freeze_after(server.state, requests=2, steps=2, fired=fired))
    greedy = dict(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(3) as pool:
        good = [pool.submit(post_generate, server, server.prompt, rid=f"beside-{i}", **greedy)
                for i in range(2)]
        assert fired.wait(30)  # both are mid-generation, the engine paused
        bad = pool.submit(post_generate, server, [*server.prompt, 10**9], rid="out-of-vocab",
                          max_new_tokens=5)
        wait_for(lambda: bad.done() or "out-of-vocab" in server.state.inflight,
                 what="the bad request to be refused or queued")
        server.engine.resume()  # a queued bad request would now join the running batch
        assert bad.result(60).status_code == 400
        assert [ok(f.result(60))["output_ids"] for f in good] == [expected, expected]


# ---------------------------------------------------------------------------- pause, abort


def test_abort_mode_pause_returns_running_requests_with_their_tokens_so_far(server, hook):
    full = list(engine_greedy(server, server.prompt, 60).token_ids)
    fired = threading.Event()
    hook(freeze_after(server.state, requests=2, steps=2, fired=fired))
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(post_generate, server, server.prompt, rid=f"ab-{i}",
                               max_new_tokens=60, temperature=0, ignore_eos=True) for i in range(2)]
        assert fired.wait(30)
        assert ok(server.client.post("/pause_generation", json={"mode": "abort"})) == {
            "message": "Generation paused successfully.", "status": "ok"}
        for future in running:
            meta = (out := ok(future.result(60)))["meta_info"]
            n = len(out["output_ids"])
            assert meta["finish_reason"] == ABORTED
            assert 0 < n < 60 and out["output_ids"] == full[:n]
            assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == n
            assert meta["weight_versions"][-1]["end"] == n
        # a new request waits while paused, and runs after /continue_generation
        late = pool.submit(post_generate, server, server.prompt, max_new_tokens=5, temperature=0)
        wait_for(lambda: server.state.held == 1, what="the new request to wait")
        assert not server.state.inflight
        assert ok(server.client.post("/continue_generation", json={"torch_empty_cache": True}))[
            "message"] == "Generation continued successfully."
        assert ok(late.result(60))["output_ids"] == full[:5]


def test_retract_update_from_disk_continue_mixes_versions(server, hook, perturbed_dir,
                                                          tiny_model_dir):
    old = str(server.engine.version)
    before = list(engine_greedy(server, server.prompt, 40).token_ids)
    fired = threading.Event()
    hook(freeze_after(server.state, requests=1, steps=3, fired=fired))
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post_generate, server, server.prompt, rid="held", max_new_tokens=40,
                            temperature=0, ignore_eos=True)
        assert fired.wait(30)
        ok(server.client.post("/pause_generation", json={"mode": "retract"}))
        second = pool.submit(post_generate, server, server.prompt, max_new_tokens=40,
                             temperature=0, ignore_eos=True)
        wait_for(lambda: server.state.held == 1, what="the new request to wait")
        # SGLang cannot flush the cache while a request waits: the update is applied, but
        # answered 400, and so is /flush_cache
        flush = server.client.post("/flush_cache")
        assert flush.status_code == 400 and "not flushed" in flush.text
        update = server.client.post("/update_weights_from_disk",
                                    json={"model_path": str(perturbed_dir),
                                          "weight_version": "7"})
        assert update.status_code == 400 and "Cache flush failed" in update.json()["message"]
        assert update.json()["num_paused_requests"] == 1
        assert ok(server.client.get("/model_info"))["model_path"] == str(tiny_model_dir)
        assert ok(server.client.get("/model_info"))["weight_version"] == "7"
        ok(server.client.post("/continue_generation", json={}))
        held, fresh = ok(first.result(60)), ok(second.result(60))

    after = list(engine_greedy(server, server.prompt, 40).token_ids)
    assert after != before  # the new weights change the output
    assert fresh["output_ids"] == after
    assert fresh["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 40}]
    meta = held["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 40}
    (v0, v1) = meta["weight_versions"]
    m = v0["end"]
    assert (v0, v1) == ({"version": old, "start": 0, "end": m},
                        {"version": "7", "start": m, "end": 40}) and 0 < m < 40
    assert meta["weight_version"] == "7"
    ids = held["output_ids"]
    assert ids[:m] == before[:m]
    # the tokens after the pause are the new weights' continuation of prompt + tokens so far
    assert ids[m:] == list(engine_greedy(server, server.prompt + ids[:m], 40 - m).token_ids)

    # without weight_version the version goes up by one (SGLang would keep it)
    restore = ok(server.client.post("/update_weights_from_disk",
                                    json={"model_path": str(tiny_model_dir)}))
    assert restore["success"] and "8" in restore["message"]
    assert ok(server.client.get("/model_info"))["model_path"] == str(tiny_model_dir)
    assert ok(server.client.get("/get_model_info"))["weight_version"] == "8"
    assert list(engine_greedy(server, server.prompt, 40).token_ids) == before


def test_update_from_a_missing_folder_fails_and_keeps_the_weights(server, tmp_path):
    version = server.engine.version
    before = ok(post_generate(server, server.prompt, max_new_tokens=6, temperature=0))
    r = server.client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "no")})
    assert r.status_code == 400
    assert r.json()["success"] is False and r.json()["num_paused_requests"] == 0
    assert server.engine.version == version
    after = ok(post_generate(server, server.prompt, max_new_tokens=6, temperature=0))
    assert after["output_ids"] == before["output_ids"]


def test_abort_request_matches_ids_by_prefix_then_all(server, hook):
    """As in SGLang, a rid aborts every request whose id starts with it."""
    fired = threading.Event()
    hook(freeze_after(server.state, requests=4, steps=1, fired=fired))
    rids = ("x-1", "x-10", "x-2", "y")
    with ThreadPoolExecutor(4) as pool:
        futures = {rid: pool.submit(post_generate, server, server.prompt, rid=rid,
                                    max_new_tokens=200, ignore_eos=True) for rid in rids}
        assert fired.wait(30)
        dup = post_generate(server, server.prompt, rid="x-2", max_new_tokens=2)
        assert dup.status_code == 400 and "rid" in dup.json()["error"]["message"]
        r = server.client.post("/abort_request", json={"rid": "x-1"})
        assert r.status_code == 200 and r.content == b""
        for rid in ("x-1", "x-10"):
            assert ok(futures[rid].result(60))["meta_info"]["finish_reason"] == ABORTED
        assert server.state.inflight == {"x-2", "y"}
        assert server.client.post("/abort_request", json={"rid": "unknown"}).status_code == 200
        assert server.state.inflight == {"x-2", "y"}
        ok_all = server.client.post("/abort_request", json={"abort_all": True})
        assert ok_all.status_code == 200
        for rid in ("x-2", "y"):
            assert ok(futures[rid].result(60))["meta_info"]["finish_reason"] == ABORTED


def test_a_client_that_goes_away_aborts_its_request(server, hook):
    fired = threading.Event()
    hook(freeze_after(server.state, requests=1, steps=1, fired=fired))
    body = httpx.Request("POST", "/generate", json={
        "input_ids": server.prompt, "rid": "gone",
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}).read()
    with socket.create_connection(("127.0.0.1", server.client.base_url.port)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert fired.wait(30)
        assert server.state.inflight == {"gone"}
    # the engine stays paused, so only the abort can end the request
    wait_for(lambda: not server.state.inflight, what="the abandoned request to be aborted")


def test_update_weight_version_aborts_and_relabels(server, hook):
    fired = threading.Event()
    hook(freeze_after(server.state, requests=1, steps=1, fired=fired))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(post_generate, server, server.prompt, max_new_tokens=200,
                              ignore_eos=True)
        assert fired.wait(30)
        r = ok(server.client.post("/update_weight_version", json={"new_version": "12"}))
        assert r == {"success": True, "message": "Weight version updated to 12",
                     "new_version": "12"}
        assert ok(running.result(60))["meta_info"]["finish_reason"] == ABORTED
    ok(server.client.post("/continue_generation", json={}))
    assert ok(server.client.get("/model_info"))["weight_version"] == "12"
    meta = ok(post_generate(server, server.prompt, max_new_tokens=3))["meta_info"]
    assert meta["weight_version"] == "12"
    assert meta["weight_versions"] == [{"version": "12", "start": 0, "end": 3}]


def test_health_generates_a_token_and_is_held_while_paused(server):
    """SGLang's /health (= /health_generate): one token through the engine, 200; while
    generation is paused the check waits, and answers 503 after the hold timeout."""
    for path in ("/health", "/health_generate"):
        server.engine.stats()
        assert server.client.get(path).status_code == 200
        assert server.engine.stats()["generated_tokens"] == 1
    ok(server.client.post("/pause_generation", json={"mode": "retract"}))
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(server.client.get, "/health")
            wait_for(lambda: server.state.held == 1, what="the health check to be held")
            assert not held.done()
            ok(server.client.post("/continue_generation", json={}))
            assert held.result(60).status_code == 200
        ok(server.client.post("/pause_generation", json={"mode": "retract"}))
        server.state.health_timeout = 0.05
        assert server.client.get("/health").status_code == 503
        assert server.state.held == 0
    finally:
        server.state.health_timeout = 20.0
        ok(server.client.post("/continue_generation", json={}))


def test_health_model_info_and_flush_cache(server, tiny_model_dir):
    assert server.client.get("/health").status_code == 200
    info = ok(server.client.get("/model_info"))
    assert info == ok(server.client.get("/get_model_info"))
    assert info["model_path"] == info["tokenizer_path"] == str(tiny_model_dir)
    assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
    assert info["weight_version"] == str(server.engine.version)
    for method in ("GET", "POST"):
        r = server.client.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
        assert r.headers["content-type"].startswith("text/plain")


BAD_BODIES = [
    ("/generate", b"{not json", "JSON"),
    ("/generate", b"[1, 2]", "JSON object"),
    ("/generate", {}, "input_ids"),
    ("/generate", {"input_ids": "abc"}, "input_ids"),
    ("/generate", {"input_ids": [1, "a"]}, "input_ids"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [[1, 2], [3]]}, "batch"),
    ("/generate", {"input_ids": [1, 10**9]}, "input_ids"),  # beyond the vocabulary
    ("/generate", {"input_ids": [1, -1]}, "input_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [10**9]}},
     "stop_token_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"sampling_seed": 2**63}},
     "sampling_seed"),
    ("/generate", {"input_ids": [1], "sampling_params": {"sampling_seed": -2**63 - 1}},
     "sampling_seed"),
    ("/generate", b"", "Field required"),  # no body at all: SGLang's 400 on every POST route
    ("/continue_generation", b"", "Field required"),
    ("/end_weight_update", b"  ", "Field required"),
    ("/generate", {"input_ids": [1], "sampling_params": "x"}, "sampling_params"),
    ("/generate", b'{"input_ids": [1], "rid": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "nested"),
    ("/generate", {"input_ids": [1], "text": "hi"}, "text"),
    ("/generate", {"input_ids": [1], "stream": True}, "stream"),
    ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ("/generate", {"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
    ("/generate", {"input_ids": [1], "bogus": 1}, "bogus"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "ten"}},
     "max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}},
     "max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop": ["."]}}, "stop"),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 2}}, "'n'"),
    ("/generate", {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
     "frequency_penalty"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_q": 0.5}}, "top_q"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/continue_generation", {"torch_empty_cache": "no"}, "torch_empty_cache"),
    ("/abort_request", {"abort_all": 1}, "abort_all"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "x", "weight_version": "v2"}, "weight_version"),
    ("/update_weights_from_disk", {"model_path": "x", "load_format": "dummy"}, "load_format"),
    ("/update_weight_version", {}, "new_version"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}, "master_port"),
    ("/begin_weight_update", {"selector": "everything"}, "selector"),
    ("/end_weight_update", {"flush": True}, "flush"),
    ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"]}, "shapes"),
    ("/update_weights_from_distributed",
     {"names": ["w"], "dtypes": ["float99"], "shapes": [[2]]}, "dtypes"),
    ("/update_weights_from_distributed",
     {"names": ["w", "v"], "dtypes": ["float32"], "shapes": [[2]]}, "names"),
]


@pytest.mark.faults
@pytest.mark.parametrize(("path", "body", "named"), BAD_BODIES)
def test_malformed_bodies_are_refused_naming_the_field(server, path, body, named):
    version = server.engine.version
    if isinstance(body, bytes):
        r = server.client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = server.client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]
    assert server.engine.version == version
    assert server.client.get("/health").status_code == 200
    assert not server.state.inflight and server.state.resumed.is_set()


def test_a_distributed_update_needs_a_session_and_the_group(server):
    """As in SGLang 0.5.23: only between /begin_weight_update and /end_weight_update, one session
    at a time; then only in the group."""
    def update() -> httpx.Response:
        return server.client.post("/update_weights_from_distributed",
                                  json={"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]})

    def refused(r: httpx.Response, message: str) -> None:
        assert r.status_code == 400 and r.json()["success"] is False
        assert message in r.json()["message"]

    refused(update(), "must run between begin_weight_update() and end_weight_update()")
    refused(server.client.post("/end_weight_update", json={}), "without begin_weight_update")
    assert ok(server.client.post("/begin_weight_update", json={"selector": "all"}))["success"]
    try:
        refused(server.client.post("/begin_weight_update", json={}), "already open")
        refused(update(), "/init_weights_update_group")
    finally:
        assert ok(server.client.post("/end_weight_update", json={}))["success"]
    refused(update(), "must run between")


# ---------------------------------------------------------------------------- `areal-flow serve`


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_flow.cli", "serve", "--model", str(tiny_model_dir),
         "--port", str(port), "--dtype", "float32"],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, f"areal-flow serve exited with {proc.returncode}"
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(healthy, timeout=120, what="areal-flow serve to answer /health")
        yield httpx.Client(base_url=url, timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def assert_serves_like(served, model, prompt) -> dict:
    """8 greedy tokens from the server equal `model`'s, logprobs included; returns the reply."""
    tokens, logprobs = greedy_reference(model, prompt, 8)
    out = ok(served.post("/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}))
    assert out["output_ids"] == tokens
    assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(
        logprobs, abs=1e-4)
    return out


def test_cli_serve_generates_over_http(served, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).encode(PROMPT_TEXT)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    out = assert_serves_like(served, model, prompt)
    # started without --weight-version: SGLang's "default", on the tokens too
    assert ok(served.get("/model_info"))["weight_version"] == "default"
    assert out["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]


def test_weights_broadcast_over_a_gloo_group(served, tiny_model_dir):
    """This process is the trainer, rank 0 of the group; the server joins at rank_offset 1."""
    from transformers import AutoTokenizer

    from areal_flow.runtime.weight_sync import WeightGroup

    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).encode(PROMPT_TEXT)
    model = perturbed_model(tiny_model_dir, seed=2)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    port = free_port()
    join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "backend": "gloo", "group_name": "weight_update_group"}
    meta = {"names": list(state), "dtypes": [str(t.dtype) for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()], "weight_version": "3",
            "group_name": "weight_update_group", "flush_cache": True}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(served.post, "/init_weights_update_group", json=join)
        group = WeightGroup.join("127.0.0.1", port, 2, backend="gloo",
                                 timeout=datetime.timedelta(seconds=30))
        try:
            assert ok(joined.result(60)) == {
                "success": True, "message": "Succeeded to initialize custom process group."}
            again = served.post("/init_weights_update_group", json=join)
            assert again.status_code == 400 and again.json()["success"] is False
            ok(served.post("/begin_weight_update", json={"selector": "all"}))
            updated = pool.submit(served.post, "/update_weights_from_distributed", json=meta)
            group.broadcast(state.values())
            assert ok(updated.result(60))["success"] is True
            ok(served.post("/end_weight_update", json={}))
        finally:
            group.close()
    assert ok(served.post("/destroy_weights_update_group", json={}))["success"] is True

    out = assert_serves_like(served, model, prompt)
    assert out["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 8}]
    assert ok(served.get("/model_info"))["weight_version"] == "3"
