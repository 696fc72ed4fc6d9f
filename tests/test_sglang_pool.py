"""The `sglang` pool against real `areal-flow serve` processes: routing, a changing address list,
a server killed mid-request, and the weight-update group path with gloo.

Four servers start together (module fixture, with the SGLang launcher); each test makes its own
pool and first loads the weights it needs. Nothing waits on a fixed sleep: tests wait for what
the servers report (`/get_load`, `/model_info`) or what the pool reports (`servers()`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import datetime
import functools
import math
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_flow import generation_pools
from areal_flow.inference.launcher import SGLangLauncher, serve_command
from areal_flow.inference.local import LocalEngine
from areal_flow.inference.sglang_pool import GenerationError, SGLangPool, WeightUpdateError
from areal_flow.inference.sglang_routing import _resubmission_seed
from areal_flow.protocol_server.app import build_app
from areal_flow.runtime import weight_sync
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.types import GenerationRequest, SamplingParams, WeightUpdate
from tests.test_local_engine import (forward_logprobs, greedy_reference, perturbed, prompts,
                                     save_perturbed)
from tests.test_protocol_server import free_port, wait_for

FP32_SERVE = functools.partial(serve_command, dtype="float32")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """Servers A, B, C, D, in fp32: tests compare their tokens with an fp32 model's (with the
    dtype measured, a CPU where bf16 decodes the tiny model faster would serve bf16)."""
    with SGLangLauncher(tiny_model_dir, gpus=[0, 1, 2, 3], command=FP32_SERVE,
                        log_dir=str(tmp_path_factory.mktemp("servers"))) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def addrs(cluster):
    return dict(zip("ABCD", cluster.addresses))


@pytest.fixture(scope="module")
def w1_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return save_perturbed(tiny_model_dir, tmp_path_factory.mktemp("w1"), 0.05, seed=21)


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30) as client:
        yield client


def req(prompt, episode_id=None, rid=None, **sampling) -> GenerationRequest:
    return GenerationRequest(input_ids=prompt, episode_id=episode_id,
                             sampling=SamplingParams(**sampling), **({"rid": rid} if rid else {}))


def greedy(prompt, n=8, **kw) -> GenerationRequest:
    return req(prompt, temperature=0, max_new_tokens=n, ignore_eos=True, **kw)


def run(coro):
    return asyncio.run(coro)


def generate_all(pool, requests):
    async def main():
        return await asyncio.gather(*(pool.generate(r) for r in requests))

    return asyncio.run(main())


def write_addresses(path: Path, *addresses: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{a}\n" for a in addresses))
    os.replace(tmp, path)


def routed(pool) -> dict[str, int]:
    return {s["address"]: s["routed"] for s in pool.servers()}


def served_greedy(http, address, prompt, n=8) -> dict:
    """A greedy generation straight from one server."""
    r = http.post(f"http://{address}/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_sglang_pool_is_registered_by_name():
    assert generation_pools.get("sglang") is SGLangPool


def test_resubmissions_of_seeded_requests_are_reseeded():
    assert _resubmission_seed(None, 5) is None
    assert _resubmission_seed(7, 0) == 7  # a first submission keeps its seed
    seeds = {_resubmission_seed(7, k) for k in (1, 2, 3)} | {_resubmission_seed(8, 1)}
    assert len(seeds) == 4 and 7 not in seeds
    assert _resubmission_seed(7, 2) == _resubmission_seed(7, 2) >= 0


def test_weight_group_settings_and_buckets():
    with pytest.raises(ValueError, match="'backend' must be one of"):
        weight_sync.WeightGroup.join("127.0.0.1", free_port(), 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        weight_sync.WeightGroup.join("127.0.0.1", free_port(), 1, backend="gloo")
    four = [(str(i), torch.zeros(4)) for i in range(5)]  # 16 bytes each
    assert [len(b) for b in weight_sync.buckets(four, 40)] == [2, 2, 1]
    big = [("a", torch.zeros(100)), ("b", torch.zeros(1))]
    assert [[n for n, _ in b] for b in weight_sync.buckets(big, 40)] == [["a"], ["b"]]


def test_least_loaded_routing_and_sticky_episodes(addrs, tiny_model_dir):
    a, b = addrs["A"], addrs["B"]
    pool = SGLangPool([a, b])
    try:
        pool.update_weights(WeightUpdate(version=1, path=str(tiny_model_dir)))

        async def spread():
            tasks = [asyncio.ensure_future(pool.generate(greedy(p, 200))) for p in prompts(4)]
            # routing is done on the pool's loop: wait until all four went out
            await asyncio.to_thread(wait_for, lambda: sum(
                s["inflight"] for s in pool.servers()) == 4, what="4 requests in flight")
            loads = {s["address"]: s["inflight"] for s in pool.servers()}
            await asyncio.gather(*tasks)
            return loads

        assert run(spread()) == {a: 2, b: 2}

        before = routed(pool)
        for turn in range(3):  # alone, least-loaded routing would alternate servers
            run(pool.generate(greedy(prompts(1)[0], 2, episode_id="episode-1")))
        after = routed(pool)
        delta = {k: after[k] - before[k] for k in after}
        assert sorted(delta.values()) == [0, 3]
        sticky = next(k for k, v in delta.items() if v == 3)
        run(pool.generate(greedy(prompts(1)[0], 2, episode_id="episode-2")))
        assert routed(pool)[sticky] == after[sticky]  # a new episode goes to the other server
    finally:
        pool.close()


def test_the_sticky_table_forgets_the_oldest_episode_past_its_capacity(addrs, tiny_model_dir):
    """A pool remembers the server of its `sticky_capacity` most recent episodes: an episode
    older than those is routed as a new one (least routed), a recent one still goes back to its
    server, however loaded (mutation testing left the eviction unchecked)."""
    pool = SGLangPool([addrs["A"], addrs["B"]], sticky_capacity=2)

    def went_to(episode):
        before = routed(pool)
        run(pool.generate(greedy(prompts(1)[0], 2, episode_id=episode)))
        return next(k for k, v in routed(pool).items() if v > before[k])

    try:
        pool.update_weights(WeightUpdate(version=1, path=str(tiny_model_dir)))
        first = went_to("e1")
        assert {went_to("e1"), went_to("e1")} == {first}  # sticky: routed 3 to 0
        other = next(a for a in routed(pool) if a != first)
        assert went_to("e2") == went_to("e3") == other  # the least routed; e1 is forgotten
        assert went_to("e1") == other  # routed as new: 3 to 2 (remembered, it went to `first`)
        assert went_to("e1") == other  # remembered again, and e2 forgotten
        assert went_to("e3") == other  # e3 still remembered, though its server is the busier
    finally:
        pool.close()


def test_a_sampled_completion_is_at_its_temperature(tiny_model_dir):
    """A sampled request's log-probs are at its temperature and its completion says so: the
    trainer divides its logits by it (a completion left at the default 1.0 would train
    against the wrong distribution)."""
    prompt = prompts(1)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with served_through(tiny_model_dir) as (address, _):
        pool = SGLangPool([address])
        try:
            out = run(pool.generate(req(prompt, temperature=0.7, max_new_tokens=5, seed=3)))
        finally:
            pool.close()
    assert out.temperature == 0.7
    expected = forward_logprobs(model, prompt, list(out.token_ids), 0.7)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_a_failed_weight_update_keeps_the_version_and_generation_going(addrs, tmp_path,
                                                                       tiny_model_dir):
    pool = SGLangPool([addrs["A"], addrs["B"]])
    try:
        pool.update_weights(WeightUpdate(version=2, path=str(tiny_model_dir)))
        with pytest.raises(WeightUpdateError, match="update_weights_from_disk failed on 2"):
            pool.update_weights(WeightUpdate(version=3, path=str(tmp_path / "missing")))
        assert pool.version == 2 and not pool.paused
        with pytest.raises(ValueError, match="local engine"):
            pool.update_weights(WeightUpdate(version=3, state_dict={}))
        out = generate_all(pool, [greedy(prompts(1)[0], 3)])[0]
        assert set(out.versions) == {2} and out.finish_reason == "length"
    finally:
        pool.close()


def test_servers_join_and_leave_through_the_addresses_file(addrs, http, tmp_path, w1_dir,
                                                           tiny_model_dir):
    """A server that joins first loads the latest weights (from disk, with their version), then
    gets requests; a server removed from the file gets none."""
    a, b, c = addrs["A"], addrs["B"], addrs["C"]
    http.post(f"http://{c}/update_weights_from_disk", json={"model_path": str(tiny_model_dir),
                                                           "weight_version": "0"})
    listing = tmp_path / "servers.txt"
    write_addresses(listing, a, b)
    pool = SGLangPool(addresses_file=listing, refresh_interval=3600)  # only refresh() re-reads
    try:
        assert sorted(s["address"] for s in pool.servers()) == sorted([a, b])
        pool.update_weights(WeightUpdate(version=5, path=str(w1_dir)))
        w1 = AutoModelForCausalLM.from_pretrained(w1_dir).eval()
        prompt = prompts(1)[0]
        expected = greedy_reference(w1, prompt, 8)

        write_addresses(listing, a, b, c)
        pool.refresh()
        assert http.get(f"http://{c}/model_info").json()["weight_version"] == "5"
        assert served_greedy(http, c, prompt)["output_ids"] == expected
        assert {s["address"]: s["in_rotation"] for s in pool.servers()} == {a: True, b: True,
                                                                             c: True}
        assert pool.weight_group_size() == 4
        before = routed(pool)
        outs = generate_all(pool, [greedy(prompt) for _ in range(3)])
        assert routed(pool)[c] > before[c]  # the newcomer (least routed) gets requests
        assert all(list(o.token_ids) == expected and set(o.versions) == {5} for o in outs)

        write_addresses(listing, b, c)
        pool.refresh()
        assert a not in {s["address"] for s in pool.servers()}
        generate_all(pool, [greedy(prompt, 2) for _ in range(4)])
        assert set(routed(pool)) == {b, c}
        assert pool.stats()["servers"] == 2
        # a weight-update group would take the trainer and the two listed servers
        assert pool.weight_group_size() == 3
    finally:
        pool.close()


def test_an_abort_reaches_only_its_own_request(addrs, http, tiny_model_dir):
    """SGLang aborts every request whose id starts with the rid given: "r1" must not abort
    "r10" (under the old ids it did, and the pool silently resubmitted it)."""
    a = addrs["A"]
    pool = SGLangPool([a])
    try:
        pool.update_weights(WeightUpdate(version=1, path=str(tiny_model_dir)))
        pool.stats()
        r1, r10 = (GenerationRequest(input_ids=prompts(1)[0], rid=rid, sampling=SamplingParams(
            temperature=0, max_new_tokens=200, ignore_eos=True)) for rid in ("r1", "r10"))

        async def main():
            tasks = [asyncio.ensure_future(pool.generate(r)) for r in (r1, r10)]
            await asyncio.to_thread(wait_for, lambda: sum(
                t >= 1 for t in http.get(f"http://{a}/get_load").json()["requests"].values()
            ) == 2, what="both requests generating")
            await asyncio.to_thread(pool.abort, "r1")
            return await asyncio.gather(*tasks)

        one, ten = run(main())
        assert one.finish_reason == "abort" and len(one.token_ids) < 200
        assert ten.finish_reason == "length" and len(ten.token_ids) == 200
        assert pool.stats()["resubmissions"] == 0
    finally:
        pool.close()


def test_no_health_checks_while_the_pool_is_paused(addrs):
    """SGLang holds /health while generation is paused (503 after ~20 s): the pool's health
    budget is above that, and it does not health-check (resume, then /health) while it has
    paused the servers."""
    a, down = addrs["A"], f"127.0.0.1:{free_port()}"  # nothing listens there
    pool = SGLangPool([a, down], refresh_interval=3600)
    paths = []
    post = pool._post

    async def recording(server, path, *args, **kwargs):
        paths.append((server.address, path))
        return await post(server, path, *args, **kwargs)

    pool._post = recording
    try:
        assert pool._health_timeout.read == 30
        pool.refresh()
        assert (down, "/continue_generation") in paths  # then /health, had it answered
        pool.pause()
        paths.clear()
        pool.refresh()
        assert paths == []
        assert {s["address"]: s["in_rotation"] for s in pool.servers()} == {a: True, down: False}
        pool.resume()
        pool.refresh()
        assert (down, "/continue_generation") in paths
    finally:
        pool.resume()  # A must not stay paused for the next tests
        pool.close()


def test_a_server_reporting_default_is_labelled_or_taken_out(addrs, tmp_path, tiny_model_dir):
    """A fresh SGLang server reports "default": the pool gives it the current weights when it
    joins; if one answers with "default" anyway (restarted unnoticed), the pool takes it out and
    finishes the requests elsewhere instead of failing them."""
    a = addrs["A"]
    with SGLangLauncher(tiny_model_dir, weight_version=None, command=FP32_SERVE,
                        log_dir=str(tmp_path / "servers")) as fresh:
        (x,) = fresh.addresses
        assert httpx.get(f"http://{x}/model_info").json()["weight_version"] == "default"
        listing = tmp_path / "servers.txt"
        write_addresses(listing, a)
        pool = SGLangPool(addresses_file=listing, refresh_interval=3600)
        try:
            pool.update_weights(WeightUpdate(version=4, path=str(tiny_model_dir)))
            pool.stats()

            async def unlabelled(server, info):  # admit it without catching it up
                pass

            pool._catch_up = unlabelled
            write_addresses(listing, a, x)
            pool.refresh()
            assert {s["address"]: s["weight_version"] for s in pool.servers()}[x] == "default"
            outs = generate_all(pool, [greedy(p, 4) for p in prompts(4)])
            assert all(set(o.versions) == {4} and len(o.token_ids) == 4 for o in outs)
            assert not {s["address"]: s["in_rotation"] for s in pool.servers()}[x]
            assert pool.stats()["dead_servers"] == 1

            del pool._catch_up
            pool.refresh()
            assert {s["address"]: (s["in_rotation"], s["weight_version"])
                    for s in pool.servers()}[x] == (True, "4")
            before = routed(pool)[x]
            outs = generate_all(pool, [greedy(p, 4) for p in prompts(4)])
            assert routed(pool)[x] > before and all(set(o.versions) == {4} for o in outs)
        finally:
            pool.close()


@pytest.mark.faults
def test_a_frozen_server_is_taken_out_of_a_weight_update_in_bounded_time(cluster, addrs, http,
                                                                        w1_dir, tiny_model_dir):
    """SIGSTOP: the server accepts connections and never answers. The update goes on without
    it after --inference.pause-timeout (not the 600 s control timeout), and the request it held
    continues on A (not after the 600 s request timeout); once it answers again it gets the
    weights it missed before it serves."""
    a, c = addrs["A"], addrs["C"]
    frozen = cluster.processes[2]
    pool = SGLangPool([a, c], pause_timeout=2, refresh_interval=3600, request_timeout=600)
    reqs = [greedy(p, 120) for p in prompts(2)]  # least-loaded routing: one on each server
    try:
        pool.update_weights(WeightUpdate(version=1, path=str(tiny_model_dir)))
        executor = ThreadPoolExecutor(2)  # not waited for: a blocked call must fail the test
        try:
            pending = executor.submit(generate_all, pool, reqs)
            wait_for(lambda: any(t >= 1 for t in http.get(f"http://{c}/get_load").json()
                                 ["requests"].values()), what="C to generate a request")
            os.killpg(frozen.pid, signal.SIGSTOP)
            began = time.monotonic()
            executor.submit(pool.update_weights,
                            WeightUpdate(version=2, path=str(w1_dir))).result(timeout=60)
            took = time.monotonic() - began
            assert {s["address"]: s["in_rotation"] for s in pool.servers()} == {a: True, c: False}
            outs = pending.result(timeout=60)
            out = generate_all(pool, [greedy(prompts(1)[0], 4)])[0]
            assert set(out.versions) == {2}
        finally:
            os.killpg(frozen.pid, signal.SIGCONT)
            executor.shutdown(wait=False)
        pool.refresh()
        assert {s["address"]: (s["in_rotation"], s["weight_version"])
                for s in pool.servers()}[c] == (True, "2")
    finally:
        pool.close()
    assert took < 30
    # C's request lost what C made (it never answered) and was made again on A, after the update
    assert all(o.finish_reason == "length" and len(o.token_ids) == 120 for o in outs)
    assert {2} in [set(o.versions) for o in outs]


@pytest.mark.faults
def test_a_server_killed_mid_request_loses_nothing(cluster, addrs, http, tiny_model_dir):
    """SIGKILL server D while it holds requests: they complete on A, nothing is lost."""
    a, d = addrs["A"], addrs["D"]
    victim = cluster.processes[3]
    pool = SGLangPool([a, d])
    n = 150
    reqs = [greedy(p, n) for p in prompts(4)]
    try:
        pool.update_weights(WeightUpdate(version=1, path=str(tiny_model_dir)))
        pool.stats()

        async def main():
            tasks = [asyncio.ensure_future(pool.generate(r)) for r in reqs]

            def holding() -> int:
                load = http.get(f"http://{d}/get_load").json()
                return sum(t >= 1 for t in load["requests"].values())

            await asyncio.to_thread(wait_for, lambda: holding() >= 2, what="D to hold requests")
            os.killpg(victim.pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

        outs = run(main())
        stats = pool.stats()
        assert {s["address"]: s["in_rotation"] for s in pool.servers()} == {a: True, d: False}
    finally:
        pool.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    decode = AutoTokenizer.from_pretrained(tiny_model_dir).decode
    assert len(outs) == len(reqs)
    for r, out in zip(reqs, outs):
        assert out.finish_reason == "length" and set(out.versions) == {1}
        assert list(out.token_ids) == greedy_reference(model, r.input_ids, n)
        assert out.text == decode(list(out.token_ids), skip_special_tokens=True)
    assert stats["dead_servers"] == 1 and stats["retries"] >= 2 and stats["requests"] == 4


@pytest.mark.faults
def test_a_server_frozen_mid_request_is_taken_out_and_its_request_finishes_elsewhere(
        cluster, addrs, http, w1_dir, tiny_model_dir):
    """SIGSTOP server B while it holds a request, with no pause to come (max_staleness 0): B's
    health check, run because it holds requests, goes unanswered, so B is taken out and the
    request continues on A at once: well within 60 s, not the 600 s request timeout. Once B
    answers again it catches up on the weights it missed and serves again."""
    a, b = addrs["A"], addrs["B"]
    frozen = cluster.processes[1]
    pool = SGLangPool([a, b], request_timeout=600, health_timeout=10)
    n = 120
    reqs = [greedy(p, n) for p in prompts(2)]  # least-loaded routing: one on each server
    try:
        pool.update_weights(WeightUpdate(version=1, path=str(tiny_model_dir)))
        pool.stats()

        async def main():
            tasks = [asyncio.ensure_future(pool.generate(r)) for r in reqs]

            def holding() -> bool:
                return any(t >= 1 for t in http.get(f"http://{b}/get_load").json()["requests"]
                           .values())

            await asyncio.to_thread(wait_for, holding, what="B to generate a request")
            os.killpg(frozen.pid, signal.SIGSTOP)
            began = time.monotonic()
            # bounded, so that a request held for the request timeout fails the test instead
            outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            return outs, time.monotonic() - began

        try:
            outs, took = run(main())
            stats = pool.stats()
            assert {s["address"]: s["in_rotation"] for s in pool.servers()} == {a: True,
                                                                               b: False}
            pool.update_weights(WeightUpdate(version=2, path=str(w1_dir)))  # B misses it
        finally:
            os.killpg(frozen.pid, signal.SIGCONT)
        wait_for(lambda: {s["address"]: (s["in_rotation"], s["weight_version"])
                          for s in pool.servers()}[b] == (True, "2"),
                 timeout=120, what="B back in rotation with version 2")
        before = routed(pool)[b]
        again = generate_all(pool, [greedy(p, 4) for p in prompts(4)])
        assert routed(pool)[b] > before and all(set(o.versions) == {2} for o in again)
    finally:
        pool.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for r, out in zip(reqs, outs):
        assert out.finish_reason == "length" and set(out.versions) == {1}
        assert list(out.token_ids) == greedy_reference(model, r.input_ids, n)
    assert stats["dead_servers"] == 1 and stats["retries"] == 1 and stats["requests"] == 2
    assert took < 60, took


@contextlib.contextmanager
def served_through(model_dir, middleware=None):
    """The real protocol server in this process, each HTTP call passing through
    `middleware(scope, receive, send, app)` (None: straight to it); yields (address, stop):
    `stop()` ends the server, so that calls to it are refused."""
    engine = LocalEngine(model_dir, max_batch_size=8)
    app = build_app(engine)

    async def wrapper(scope, receive, send):
        if middleware is None or scope["type"] != "http":
            return await app(scope, receive, send)
        await middleware(scope, receive, send, app)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(wrapper, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def stop():
        uv.should_exit = True
        thread.join(timeout=30)

    try:
        wait_for(lambda: uv.started, what="uvicorn to start")
        yield f"127.0.0.1:{sock.getsockname()[1]}", stop
    finally:
        stop()
        engine.close()


@contextlib.contextmanager
def served_with_500s(model_dir, failures: float):
    """The real protocol server behind a wrapper that answers its first `failures` /generate
    calls with 500; yields (address, calls still to fail)."""
    left = {"n": failures}

    async def fail_first(scope, receive, send, app):
        if scope["path"] == "/generate" and left["n"] > 0:
            left["n"] -= 1
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body",
                        "body": b'{"error": {"message": "injected"}}'})
            return
        await app(scope, receive, send)

    with served_through(model_dir, fail_first) as (address, _):
        yield address, left


def edited_replies(edit, recorded: dict[str, list] | None = None):
    """Middleware: each /generate reply becomes `edit(reply, k)` (k: the call's index); the
    bodies of calls to the paths in `recorded` are appended there."""
    import json

    calls = []

    async def middleware(scope, receive, send, app):
        if recorded is not None and scope["path"] in recorded:
            body, more = b"", True
            while more:
                message = await receive()
                body, more = body + message.get("body", b""), message.get("more_body", False)
            recorded[scope["path"]].append(json.loads(body or b"{}"))
            replayed, receive_rest = [], receive

            async def receive():  # noqa: F811 - the body read above once, then the client's
                if replayed:
                    return await receive_rest()
                replayed.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
        if scope["path"] != "/generate":
            return await app(scope, receive, send)
        messages = []

        async def keep(message):
            messages.append(message)

        await app(scope, receive, keep)
        start, body = messages[0], b"".join(m.get("body", b"") for m in messages[1:])
        if start["status"] == 200:
            body = json.dumps(edit(json.loads(body), len(calls))).encode()
            calls.append(body)
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return middleware, calls


@pytest.mark.faults
def test_a_5xx_answer_is_retried_and_never_takes_the_server_out(tiny_model_dir):
    """A server that answers, even 500, is alive: the request is retried and the server stays
    in rotation (taken out, it would leave the request waiting for a server: 10 s here)."""
    prompt = prompts(1)[0]
    with served_with_500s(tiny_model_dir, failures=2) as (address, left):
        pool = SGLangPool([address], no_server_timeout=10)
        try:
            out = run(pool.generate(greedy(prompt, 6)))
            stats = pool.stats()
            assert [s["in_rotation"] for s in pool.servers()] == [True]
        finally:
            pool.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert left["n"] == 0 and list(out.token_ids) == greedy_reference(model, prompt, 6)
    assert stats["dead_servers"] == 0 and stats["retries"] == 2


@pytest.mark.faults
def test_after_a_5xx_the_retry_goes_to_another_server(tiny_model_dir):
    reqs = [greedy(p, 4) for p in prompts(4)]
    with served_with_500s(tiny_model_dir, failures=math.inf) as (broken, _), \
            served_with_500s(tiny_model_dir, failures=0) as (working, _):
        pool = SGLangPool([broken, working], retries=1, no_server_timeout=10)
        try:
            outs = generate_all(pool, reqs)
            stats = pool.stats()
            routes = routed(pool)
            assert all(s["in_rotation"] for s in pool.servers())
        finally:
            pool.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert [list(o.token_ids) for o in outs] == [greedy_reference(model, r.input_ids, 4)
                                                for r in reqs]
    # least-loaded routing sent some first tries to the broken server; each retried once, on
    # the working one (retries=1: a second try on the broken one would have failed the request)
    assert routes[broken] >= 1 and routes[working] == 4
    assert stats["retries"] == routes[broken] and stats["dead_servers"] == 0


GROUP_TIMEOUT = datetime.timedelta(seconds=60)
"""A refused bucket leaves the trainer's broadcast waiting for the group's timeout: fail soon."""


def test_bucketed_weights_over_a_gloo_group(addrs, http, tmp_path, tiny_model_dir, monkeypatch):
    """The trainer joins the weight-update group as rank 0 and broadcasts the weights in buckets,
    inside a weight-update session on each server; both servers then generate exactly as the
    trainer's model. A server that joins afterwards is not in the group: it loads the last
    folder, and stays out of rotation until a new group brings it the current weights."""
    a, b, c = addrs["A"], addrs["B"], addrs["C"]
    http.post(f"http://{c}/update_weights_from_disk", json={"model_path": str(tiny_model_dir),
                                                           "weight_version": "0"})
    listing = tmp_path / "servers.txt"
    write_addresses(listing, a, b)
    pool = SGLangPool(addresses_file=listing, refresh_interval=3600)
    group = None
    try:
        pool.update_weights(WeightUpdate(version=10, path=str(tiny_model_dir)))
        group = weight_sync.connect(pool, "127.0.0.1", free_port(), backend="gloo",
                                    group_name="test_group", timeout=GROUP_TIMEOUT)
        trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        trainer.load_state_dict(perturbed(trainer, 0.05, seed=22))
        trainer.save_pretrained(tmp_path / "trained")
        state = trainer.state_dict()
        labels = []
        update = pool.update_weights
        monkeypatch.setattr(pool, "update_weights",
                            lambda u: (labels.append(u.version), update(u))[1])
        total = sum(t.numel() * t.element_size() for t in state.values())
        # the FSDP runtime gathers its shards and sends them over the group in buckets
        runtime = TrainEngine(tmp_path / "trained", TrainConfig())
        seconds = runtime.sync_weights(pool, 11, group=group, bucket_bytes=total // 3)
        buckets = len(labels)
        assert buckets >= 3 and labels == [10] * (buckets - 1) + [11]
        assert seconds["sync/send_seconds"] > 0
        assert pool.version == 11 and not pool.paused

        prompt = prompts(1)[0]
        tokens = greedy_reference(trainer, prompt, 8)
        logprobs = forward_logprobs(trainer, prompt, tokens, 1.0)
        for address in (a, b):
            out = served_greedy(http, address, prompt)
            assert out["output_ids"] == tokens
            torch.testing.assert_close(
                torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]),
                logprobs, atol=1e-4, rtol=1e-4)
            assert out["meta_info"]["weight_version"] == "11"
            # the session was closed after the last bucket: a new one opens
            for step in ("/begin_weight_update", "/end_weight_update"):
                assert http.post(f"http://{address}{step}", json={}).json()["success"]

        write_addresses(listing, a, b, c)
        pool.refresh()
        assert http.get(f"http://{c}/model_info").json()["weight_version"] == "10"
        newcomer = {s["address"]: s for s in pool.servers()}[c]
        assert newcomer["healthy"] and newcomer["stale"] and not newcomer["in_rotation"]
        assert pool.stats()["servers_stale"] == 1
        generate_all(pool, [greedy(prompt, 2) for _ in range(4)])
        assert routed(pool)[c] == 0

        pool.destroy_weight_group(group.group_name)
        group.close()
        group = weight_sync.connect(pool, "127.0.0.1", free_port(), backend="gloo",
                                    group_name="test_group_2", timeout=GROUP_TIMEOUT)  # C too
        assert group.world_size == 4
        trainer.load_state_dict(perturbed(trainer, 0.05, seed=23))
        weight_sync.broadcast_buckets(pool, group, trainer.state_dict().items(), version=12,
                                      bucket_bytes=total // 3)
        newcomer = {s["address"]: s for s in pool.servers()}[c]
        assert newcomer["in_rotation"] and not newcomer["stale"]
        assert newcomer["weight_version"] == "12" and pool.stats()["servers_stale"] == 0
        assert served_greedy(http, c, prompt)["output_ids"] == greedy_reference(trainer, prompt, 8)
    finally:
        if group is not None:
            pool.destroy_weight_group(group.group_name)
            group.close()
        pool.close()
        if torch.distributed.is_initialized():  # the runtime's own one-process world
            torch.distributed.destroy_process_group()


# -- issue 36: attaching to servers another run used ------------------------------------------


def test_a_lora_run_attaching_loads_its_base_model_or_refuses_naming_the_server(
        addrs, http, tiny_model_dir, w1_dir, tmp_path):
    """An adapter runs over whatever base a server holds: a LoRA run attaching to a server that
    a full-weight run updated first loads its own base model; one that cannot is refused."""
    from areal_flow.config import InferenceConfig
    from areal_flow.lora import LoraConfig

    d = addrs["C"]  # D was killed above
    prompt = prompts(1)[0]
    # what the base model answers (earlier tests leave C with other weights)
    assert http.post(f"http://{d}/update_weights_from_disk", json={
        "model_path": str(tiny_model_dir), "weight_version": "1"}).json()["success"]
    base = served_greedy(http, d, prompt)["output_ids"]
    assert http.post(f"http://{d}/update_weights_from_disk", json={
        "model_path": str(w1_dir), "weight_version": "9"}).json()["success"]
    assert served_greedy(http, d, prompt)["output_ids"] != base  # another run's weights
    config = InferenceConfig(backend="sglang", addresses=(d,), lease_dir=str(tmp_path))
    unloadable = tmp_path / "tokenizer_only"  # a tokenizer (the pool's), but no weights
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(unloadable)
    with pytest.raises(WeightUpdateError, match=rf"{d} holds '{w1_dir}' at weight version 9, "
                                                rf"not this LoRA run's base model '{unloadable}'"):
        SGLangPool.from_config(config, model=str(unloadable), lora=LoraConfig(rank=4))
    pool = SGLangPool.from_config(config, model=str(tiny_model_dir), lora=LoraConfig(rank=4))
    try:
        assert http.get(f"http://{d}/model_info").json()["model_path"] == str(tiny_model_dir)
        out = generate_all(pool, [greedy(prompt)])[0]
        assert list(out.token_ids) == base and set(out.versions) == {0}
    finally:
        pool.close()


def test_a_session_left_open_by_a_killed_trainer_never_wedges_the_server(addrs, http,
                                                                         tiny_model_dir):
    """A trainer killed between /begin_weight_update and /end_weight_update leaves the session
    open (SGLang refuses every later begin): a run attaching ends it, and a pool whose begin is
    refused ends it and begins again."""
    d = addrs["C"]  # D was killed above
    assert http.post(f"http://{d}/begin_weight_update", json={}).json()["success"]  # then killed
    pool = SGLangPool([d])
    group = None
    try:
        # attaching ended it: no session is open now
        assert "without begin" in http.post(f"http://{d}/end_weight_update", json={}).text
        group = weight_sync.connect(pool, "127.0.0.1", free_port(), backend="gloo",
                                    group_name="wedge_group", timeout=GROUP_TIMEOUT)
        state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        # a session left open while the pool holds the server (an answer lost, say)
        assert http.post(f"http://{d}/begin_weight_update", json={}).json()["success"]
        weight_sync.broadcast_buckets(pool, group, state.items(), version=3)
        assert http.get(f"http://{d}/model_info").json()["weight_version"] == "3"
        assert "without begin" in http.post(f"http://{d}/end_weight_update", json={}).text
    finally:
        if group is not None:
            pool.destroy_weight_group(group.group_name)
            group.close()
        pool.close()


def test_user_seeds_are_folded_into_sglangs_range_and_lora_errors_read_from_error_message(
        addrs, http):
    import httpx as _httpx

    from areal_flow.inference.sglang_servers import error_message, lora_error

    prompt = prompts(1)[0]
    pool = SGLangPool([addrs["A"]])
    try:
        sampled = dict(max_new_tokens=6, temperature=1.0, ignore_eos=True)
        out = generate_all(pool, [req(prompt, seed=2**64 - 1, **sampled)])[0]
    finally:
        pool.close()
    direct = http.post(f"http://{addrs['A']}/generate", json={
        "input_ids": prompt, "sampling_params": {**sampled, "sampling_seed": -1}}).json()
    assert list(out.token_ids) == direct["output_ids"]
    reply = _httpx.Response(400, json={"success": False, "loaded_adapters": {},
                                       "error_message": "LoRA with name policy does not exist"})
    assert lora_error(reply) == error_message(reply) == "LoRA with name policy does not exist"
    printed = _httpx.Response(400, json={"success": False, "error_message": None,
                                         "loaded_adapters": {"does not exist": "/x"}})
    assert lora_error(printed) == ""


def test_lora_target_modules_sglang_rejects_are_refused_at_start():
    from areal_flow.inference.launcher import lora_args
    from areal_flow.lora import LoraConfig

    with pytest.raises(ValueError, match=r"\['c_attn'\] are not module names SGLang .* "
                                         r"allowed: all-linear, or some of q_proj k_proj"):
        lora_args("sglang", LoraConfig(rank=4, target_modules=("c_attn",)))
    assert lora_args("sglang", LoraConfig(rank=4, target_modules=("q_proj", "v_proj")))[-2:] \
        == ("q_proj", "v_proj")
    assert lora_args("sglang", LoraConfig(rank=4))[-1] == "all"


@pytest.mark.faults
def test_a_run_started_with_its_servers_waits_for_them_to_answer(tiny_model_dir, tmp_path,
                                                                  caplog):
    """Servers started next to the run (a SLURM job, a supervisor) are still loading when the
    run starts: it waits for one to answer /health, saying so, instead of failing at once."""
    import subprocess
    import sys

    from areal_flow.config import InferenceConfig

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "areal_flow.cli", "serve", "--model", str(tiny_model_dir),
         "--port", str(port), "--dtype", "float32"], env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        config = InferenceConfig(backend="sglang", addresses=(f"127.0.0.1:{port}",),
                                 lease_dir=str(tmp_path / "leases"), startup_timeout=120)
        with caplog.at_level("WARNING", logger="areal_flow.inference.sglang_pool"):
            pool = SGLangPool.from_config(config, model=str(tiny_model_dir))
        try:
            assert [s["in_rotation"] for s in pool.servers()] == [True]
        finally:
            pool.close()
        assert "waiting for a generation server to answer /health" in caplog.text
    finally:
        server.terminate()
        server.wait(timeout=30)


# -- what the pool makes of each kind of reply (mutation testing of the routing and
#    resubmission functions found these unchecked) --------------------------------------------


def relabel(reply, spans, version):
    """A reply whose tokens carry the given weight-version spans [(label, start, end)] (None:
    no spans, as an older SGLang sends) and `weight_version`."""
    meta = reply["meta_info"]
    meta.pop("weight_versions", None)
    if spans is not None:
        meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]
    meta["weight_version"] = version
    return reply


def test_per_token_versions_come_from_the_replys_spans(tiny_model_dir):
    """A reply whose weights changed mid-request labels its tokens by spans; one without spans
    labels them all with `weight_version`; a reply of older weights than the pool had when it
    sent the request is counted (`behind_replies`), one of the same is not."""
    labels = [([("3", 0, 2), ("4", 2, 6)], "4"), (None, "5"), ([("6", 0, 6)], "6"),
              ([("7", 0, 6)], "7")]
    middleware, calls = edited_replies(lambda reply, k: relabel(reply, *labels[k]))
    prompt = prompts(1)[0]
    with served_through(tiny_model_dir, middleware) as (address, _):
        pool = SGLangPool([address], version=7)
        try:
            outs = [run(pool.generate(greedy(prompt, 6))) for _ in labels]
            stats = pool.stats()
        finally:
            pool.close()
    assert [list(o.versions) for o in outs] == [[3, 3, 4, 4, 4, 4], [5] * 6, [6] * 6, [7] * 6]
    assert stats["behind_replies"] == 3 and stats["requests"] == 4


def test_an_empty_abort_is_resubmitted_and_a_full_one_ends_as_length(tiny_model_dir):
    """SGLang aborts a request still in its queue with no token: the pool sends it again. An
    abort that came with every token the request may have is its end ("length"): nothing is
    sent again."""
    def edit(reply, k):
        meta = reply["meta_info"]
        if k == 0:  # aborted in the queue
            reply["output_ids"], reply["text"] = [], ""
            meta.update(output_token_logprobs=[], weight_versions=[],
                        finish_reason={"type": "abort", "message": "aborted"})
        if k == 2:  # aborted just as its last token came
            meta["finish_reason"] = {"type": "abort", "message": "aborted"}
        return reply

    middleware, calls = edited_replies(edit)
    prompt = prompts(1)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with served_through(tiny_model_dir, middleware) as (address, _):
        pool = SGLangPool([address])
        try:
            first = run(pool.generate(greedy(prompt, 5)))
            assert (len(calls), pool.stats()["resubmissions"]) == (2, 1)
            second = run(pool.generate(greedy(prompt, 5)))
            assert len(calls) == 3
        finally:
            pool.close()
    for out in (first, second):
        assert list(out.token_ids) == greedy_reference(model, prompt, 5)
        assert out.finish_reason == "length" and len(out.logprobs) == len(out.versions) == 5


@pytest.mark.faults
def test_a_server_that_keeps_failing_fails_the_request_after_the_retries(tiny_model_dir):
    with served_with_500s(tiny_model_dir, failures=math.inf) as (address, _):
        pool = SGLangPool([address], retries=2, no_server_timeout=10)

        async def bounded():  # a pool that retried forever would fail the test, not hang it
            return await asyncio.wait_for(pool.generate(greedy(prompts(1)[0], 4)), 60)

        try:
            with pytest.raises(GenerationError, match="failed 3 times"):
                run(bounded())
            assert pool.stats()["retries"] == 2
        finally:
            pool.close()


def test_aborts_reach_the_server_only_for_a_request_it_runs(tiny_model_dir):
    """A request interrupted by a pause waits for `resume` on no server: aborting it then
    returns its tokens at once and sends the server nothing. Cancelling the caller of a
    running request sends /abort_request with the id the server knows it by."""
    recorded = {"/abort_request": []}
    middleware, _ = edited_replies(lambda reply, k: reply, recorded)
    prompt = prompts(1)[0]
    with served_through(tiny_model_dir, middleware) as (address, _):
        pool = SGLangPool([address])
        try:
            async def interrupted():
                task = asyncio.ensure_future(pool.generate(
                    req(prompt, rid="waiting", max_new_tokens=400, ignore_eos=True,
                        temperature=0)))
                # paused as soon as it has a token (a fixed sleep let a fast machine finish all
                # 400 tokens first)
                await asyncio.to_thread(wait_for, lambda: any(
                    t >= 1 for t in httpx.get(f"http://{address}/get_load").json()
                    ["requests"].values()), what="the request generating")
                await asyncio.to_thread(pool.pause)
                # the interrupted reply is in: the request waits on no server
                await asyncio.to_thread(wait_for, lambda: pool.stats()["running"] == 0)
                await asyncio.to_thread(pool.abort, "waiting")
                return await asyncio.wait_for(task, 30)

            out = run(interrupted())
            assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 400
            assert recorded["/abort_request"] == []
            pool.resume()

            async def cancelled():
                task = asyncio.ensure_future(pool.generate(
                    req(prompt, rid="cancelled", max_new_tokens=400, ignore_eos=True,
                        temperature=0)))
                await asyncio.to_thread(wait_for, lambda: any(  # running on the server now
                    t >= 1 for t in httpx.get(f"http://{address}/get_load").json()
                    ["requests"].values()), what="the request generating")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            run(cancelled())
            wait_for(lambda: recorded["/abort_request"], what="the /abort_request call")
            [body] = recorded["/abort_request"]
            assert body["rid"].endswith("-cancelled")
        finally:
            pool.close()


def test_closing_the_pool_ends_its_running_requests_and_counts_each_dead_server(tiny_model_dir):
    """Servers that stop answering are each counted once (`dead_servers`) and their requests
    finish elsewhere; closing the pool while a request runs ends that request with an error
    naming the close, and leaves no task behind."""
    prompt = prompts(1)[0]
    with served_through(tiny_model_dir) as (a, stop_a), \
            served_through(tiny_model_dir) as (b, stop_b), \
            served_through(tiny_model_dir) as (c, _):
        pool = SGLangPool([a, b, c], no_server_timeout=10)
        try:
            stop_a(), stop_b()
            tasks = len(pool._tasks)  # the pool's own (the periodic refresh)
            outs = generate_all(pool, [greedy(prompt, 3) for _ in range(4)])
            assert all(len(o.token_ids) == 3 for o in outs)
            assert pool.stats()["dead_servers"] == 2
            assert len(pool._tasks) == tasks  # finished requests leave no task behind
            assert not any(s.posts for s in pool._servers.values())  # nor calls

            async def closed_meanwhile():
                task = asyncio.ensure_future(pool.generate(
                    req(prompt, max_new_tokens=400, ignore_eos=True, temperature=0)))
                await asyncio.to_thread(wait_for, lambda: any(  # running on c, the one left
                    t >= 1 for t in httpx.get(f"http://{c}/get_load").json()
                    ["requests"].values()), what="the request generating")
                await asyncio.to_thread(pool.close)
                return await asyncio.wait_for(task, 30)

            with pytest.raises(RuntimeError, match="the SGLang pool was closed"):
                run(closed_meanwhile())
        finally:
            pool.close()


def empty_abort(reply, status=None):
    """A reply aborted before its first token (`status`: the error status SGLang gave)."""
    reply["output_ids"], reply["text"] = [], ""
    finish = {"type": "abort", "message": "aborted"}
    if status is not None:
        finish["status_code"] = status
    reply["meta_info"].update(output_token_logprobs=[], weight_versions=[],
                              finish_reason=finish)
    return reply


@pytest.mark.faults
def test_a_server_that_keeps_aborting_fails_the_request_after_the_retries(tiny_model_dir):
    """Aborts nobody here asked for are stalls: the request is sent again `retries` times, then
    fails naming the server; an abort with an error status fails it at once."""
    middleware, calls = edited_replies(lambda reply, k: empty_abort(reply))
    with served_through(tiny_model_dir, middleware) as (address, _):
        pool = SGLangPool([address], retries=2)

        async def bounded():  # a pool that retried forever would fail the test, not hang it
            return await asyncio.wait_for(pool.generate(greedy(prompts(1)[0], 4)), 60)

        try:
            with pytest.raises(GenerationError, match="keeps aborting"):
                run(bounded())
            assert len(calls) == 3 and pool.stats()["resubmissions"] == 2
        finally:
            pool.close()
    for status in (400, 503):
        middleware, calls = edited_replies(lambda reply, k: empty_abort(reply, status))  # noqa
        with served_through(tiny_model_dir, middleware) as (address, _):
            pool = SGLangPool([address], retries=2)
            try:
                with pytest.raises(GenerationError, match=f"aborted request .*\\({status}\\)"):
                    run(pool.generate(greedy(prompts(1)[0], 4)))
                assert len(calls) == 1
            finally:
                pool.close()


def test_an_interruption_by_the_pools_own_pause_is_no_stall(tiny_model_dir):
    """With no retries left, a request the pool itself interrupted still completes after
    `resume`, continuing from its tokens."""
    prompt = prompts(1)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with served_through(tiny_model_dir) as (address, _):
        pool = SGLangPool([address], retries=0)
        try:
            def generating() -> bool:
                with httpx.Client(timeout=10) as client:
                    load = client.get(f"http://{address}/get_load").json()["requests"]
                return any(n >= 1 for n in load.values())

            async def interrupted():
                task = asyncio.ensure_future(pool.generate(greedy(prompt, 400)))
                await asyncio.to_thread(wait_for, generating, what="the request to run")
                await asyncio.to_thread(pool.pause)
                await asyncio.to_thread(pool.resume)
                return await asyncio.wait_for(task, 60)

            out = run(interrupted())
            assert pool.stats()["resubmissions"] == 1
        finally:
            pool.close()
    assert list(out.token_ids) == greedy_reference(model, prompt, 400)


@pytest.mark.faults
def test_with_no_server_in_rotation_a_request_waits_then_fails_naming_the_timeout(
        tiny_model_dir):
    with served_through(tiny_model_dir) as (address, stop):
        pool = SGLangPool([address], no_server_timeout=2)
        try:
            stop()

            async def bounded():
                return await asyncio.wait_for(pool.generate(greedy(prompts(1)[0], 4)), 60)

            began = time.monotonic()
            with pytest.raises(GenerationError, match="no SGLang server in rotation for 2 s"):
                run(bounded())
            assert 2 <= time.monotonic() - began < 30
        finally:
            pool.close()


@pytest.mark.faults
def test_an_episodes_next_turn_leaves_its_server_once_that_is_out(tiny_model_dir):
    """Turns of an episode stick to one server while it is in rotation; when it stops
    answering, the next turn goes to another."""
    prompt = prompts(1)[0]
    with served_through(tiny_model_dir) as (a, stop_a), \
            served_through(tiny_model_dir) as (b, stop_b):
        pool = SGLangPool([a, b], retries=2, no_server_timeout=10)
        stops = {a: stop_a, b: stop_b}
        try:
            run(pool.generate(greedy(prompt, 3, episode_id="e")))
            [first] = [s for s, n in routed(pool).items() if n == 1]
            stops[first]()
            out = run(pool.generate(greedy(prompt, 3, episode_id="e")))
            assert len(out.token_ids) == 3
            assert [s["address"] for s in pool.servers() if s["in_rotation"]] == \
                [s for s in (a, b) if s != first]
        finally:
            pool.close()


def test_the_generate_body_says_what_sglang_reads(tiny_model_dir):
    """max_new_tokens is what is left, no_stop_trim keeps the stop token in the text (as the
    local engine does), and a seed goes as SGLang's signed int64 for sampled requests only."""
    recorded = {"/generate": []}
    middleware, _ = edited_replies(lambda reply, k: reply, recorded)
    prompt = prompts(1)[0]
    seeds = [None, 1000, 2**63, 2**63 + 5]
    with served_through(tiny_model_dir, middleware) as (address, _):
        pool = SGLangPool([address])
        try:
            for seed in seeds:
                run(pool.generate(req(prompt, max_new_tokens=3, ignore_eos=True,
                                      temperature=1.0, seed=seed)))
            run(pool.generate(greedy(prompt, 3, seed=7)))
        finally:
            pool.close()
    bodies = [body["sampling_params"] for body in recorded["/generate"]]
    assert all(b["max_new_tokens"] == 3 and b["no_stop_trim"] is True for b in bodies)
    assert [b.get("sampling_seed") for b in bodies] == [None, 1000, -2**63, 5 - 2**63, None]


@pytest.mark.faults
def test_a_generate_call_past_the_request_timeout_takes_its_server_out(tiny_model_dir):
    async def slow(scope, receive, send, app):
        if scope["path"] == "/generate":
            await asyncio.sleep(5)  # past the 2 s request timeout; the server closes after it
        await app(scope, receive, send)

    prompt = prompts(1)[0]
    with served_through(tiny_model_dir, slow) as (stuck, _), \
            served_through(tiny_model_dir) as (working, _):
        pool = SGLangPool([stuck, working], request_timeout=2, no_server_timeout=10)
        try:
            began = time.monotonic()
            outs = generate_all(pool, [greedy(prompt, 3) for _ in range(2)])
            took = time.monotonic() - began
            assert all(len(o.token_ids) == 3 for o in outs) and took < 20
            assert pool.stats()["dead_servers"] == 1
            assert [s["address"] for s in pool.servers() if s["in_rotation"]] == [working]
        finally:
            pool.close()


def test_a_completion_holds_the_servers_logprobs_text_and_counts(tiny_model_dir):
    """What the pool returns is what the server generated: each token's log-prob (against a
    forward pass of the model), the text (the server's, or the pool tokenizer's decoding), the
    temperature the log-probs are at; `generated_tokens` counts every token of every reply."""
    prompt = prompts(1)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with served_through(tiny_model_dir) as (address, _):
        plain, decoding = SGLangPool([address]), SGLangPool([address], tokenizer=tiny_model_dir)
        try:
            outs = [run(p.generate(greedy(prompt, 6))) for p in (plain, decoding)]
            assert (plain.stats()["generated_tokens"], decoding.stats()["generated_tokens"]) \
                == (6, 6)
            run(plain.generate(greedy(prompt, 2)))
            run(plain.generate(greedy(prompt, 3)))
            assert plain.stats()["generated_tokens"] == 5
        finally:
            plain.close(), decoding.close()
    tokens = greedy_reference(model, prompt, 6)
    expected = forward_logprobs(model, prompt, tokens, 1.0)
    for out in outs:
        assert list(out.token_ids) == tokens and out.temperature == 1.0
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)
        assert out.text == tokenizer.decode(tokens, skip_special_tokens=True)
