"""The generation-pool contract (DESIGN.md "Generation"), one suite for every pool.

Each pool is given by a `Backend`: the pool, a way to load weights from a folder, a deterministic
trigger that waits until requests are generating, and a count of requests the backend still holds.
The suite runs against the in-process local engine and against the `sglang` pool talking over HTTP
to two `areal-flow serve` processes; a third-party pool passes it by adding a `Backend` here.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_flow.inference.launcher import SGLangLauncher, serve_command
from areal_flow.inference.local import LocalEngine
from areal_flow.inference.sglang_pool import SGLangPool
from areal_flow.types import Completion, GenerationPool, GenerationRequest, SamplingParams, WeightUpdate
from tests.test_local_engine import forward_logprobs, greedy_reference, perturbed, prompts
from tests.test_protocol_server import wait_for

FP32_SERVE = functools.partial(serve_command, dtype="float32")


@attrs.define
class Backend:
    pool: GenerationPool
    wait_generating: Callable[[int, int], None]
    """Blocks until `n` requests are generating with at least `k` tokens each. The pool may be
    paused on return (the local engine pauses at that exact step); tests call `pause()` and
    `resume()` anyway."""
    held: Callable[[], int]
    """Requests the backend still holds (running or queued)."""
    version: int = 0

    def load(self, path: Path) -> int:
        """Load weights from a folder under the next version; returns it."""
        self.version += 1
        self.pool.update_weights(WeightUpdate(version=self.version, path=str(path)))
        return self.version


def local_backend(model_dir: Path) -> Backend:
    engine = LocalEngine(model_dir, max_batch_size=16)

    def wait_generating(n: int, k: int) -> None:
        reached = threading.Event()

        def on_step(eng: LocalEngine) -> None:
            running = eng._running
            if len(running) >= n and min(len(s.tokens) for s in running) >= k:
                eng.pause(wait=False)  # at this very step
                eng.on_step = None
                reached.set()

        engine.on_step = on_step
        assert reached.wait(60), "the requests never started"

    def held() -> int:
        stats = engine.stats()
        return int(stats["running"] + stats["queued"])

    return Backend(pool=engine, wait_generating=wait_generating, held=held)


def sglang_backend(addresses: list[str], model_dir: Path) -> Backend:
    pool = SGLangPool(addresses, tokenizer=str(model_dir))
    client = httpx.Client(timeout=10)

    def loads() -> list[dict]:
        return [client.get(f"http://{a}/get_load").json() for a in addresses]

    def wait_generating(n: int, k: int) -> None:
        # the servers report every in-flight request with its tokens so far
        wait_for(lambda: sum(t >= k for load in loads() for t in load["requests"].values()) >= n,
                 what=f"{n} requests generating on the servers")

    def held() -> int:
        return sum(load["num_reqs"] + load["num_waiting_reqs"] for load in loads())

    return Backend(pool=pool, wait_generating=wait_generating, held=held)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    w1 = tmp_path_factory.mktemp("w1")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.load_state_dict(perturbed(model, 0.05, seed=11))
    model.save_pretrained(w1)
    return {"w0": Path(tiny_model_dir), "w1": w1}


@pytest.fixture(scope="module")
def models(model_dirs):
    return {k: AutoModelForCausalLM.from_pretrained(v).eval() for k, v in model_dirs.items()}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """Two `areal-flow serve` processes, started with the SGLang launcher."""
    # float32: the references are fp32 forwards, and "auto" measures (it may pick bf16)
    with SGLangLauncher(tiny_model_dir, gpus=[0, 1], command=FP32_SERVE,
                        log_dir=str(tmp_path_factory.mktemp("servers"))) as launcher:
        yield launcher.addresses


@pytest.fixture(scope="module", params=["local", "sglang"])
def backend(request, tiny_model_dir):
    if request.param == "local":
        b = local_backend(tiny_model_dir)
    else:
        b = sglang_backend(request.getfixturevalue("served"), tiny_model_dir)
    yield b
    b.pool.close()


def req(prompt, **sampling) -> GenerationRequest:
    return GenerationRequest(input_ids=prompt, sampling=SamplingParams(**sampling))


def generate_all(pool: GenerationPool, requests: list[GenerationRequest]) -> list[Completion]:
    async def main():
        return await asyncio.gather(*(pool.generate(r) for r in requests))

    return asyncio.run(main())


def test_both_pools_satisfy_the_protocol(backend):
    assert isinstance(backend.pool, GenerationPool)


def test_logprobs_equal_a_full_forward_of_the_same_weights(backend, models, tiny_model_dir):
    sampled = [req(p, temperature=0.7, top_p=0.9, max_new_tokens=20, ignore_eos=True, seed=i)
               for i, p in enumerate(prompts(4))]
    greedy = [req(p, temperature=0, max_new_tokens=20, ignore_eos=True) for p in prompts(3, 40)]
    outs = generate_all(backend.pool, sampled + greedy)
    decode = AutoTokenizer.from_pretrained(tiny_model_dir).decode
    for r, out in zip(sampled + greedy, outs):
        temperature = r.sampling.logprob_temperature
        assert out.temperature == temperature and len(out.token_ids) == 20
        torch.testing.assert_close(
            torch.tensor(out.logprobs),
            forward_logprobs(models["w0"], r.input_ids, out.token_ids, temperature),
            atol=1e-4, rtol=1e-4)
        assert out.text == decode(list(out.token_ids), skip_special_tokens=True)
    for r, out in zip(greedy, outs[len(sampled):]):
        assert list(out.token_ids) == greedy_reference(models["w0"], r.input_ids, 20)


def test_greedy_decoding_is_deterministic_whatever_the_batch(backend):
    alone = generate_all(backend.pool, [req([7, 8, 9], temperature=0, max_new_tokens=16,
                                            ignore_eos=True)])[0]
    crowd = [req(p, temperature=1.0, max_new_tokens=16, ignore_eos=True) for p in prompts(5)]
    mixed = generate_all(backend.pool, [*crowd, req([7, 8, 9], temperature=0, max_new_tokens=16,
                                                    ignore_eos=True)])[-1]
    assert mixed.token_ids == alone.token_ids


def test_finish_reasons_stop_and_length(backend, models):
    prompt = prompts(1)[0]
    full = greedy_reference(models["w0"], prompt, 10)
    stop = full[5]
    stopped, capped = generate_all(backend.pool, [
        req(prompt, temperature=0, max_new_tokens=10, ignore_eos=True, stop_token_ids=[stop]),
        req(prompt, temperature=0, max_new_tokens=4, ignore_eos=True)])
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == full[: full.index(stop) + 1]
    assert capped.finish_reason == "length" and list(capped.token_ids) == full[:4]


def test_tokens_carry_the_version_of_the_loaded_weights(backend, models, model_dirs):
    prompt = prompts(1)[0]
    try:
        version = backend.load(model_dirs["w1"])
        assert backend.pool.version == version
        out = generate_all(backend.pool, [req(prompt, temperature=1.0, max_new_tokens=12,
                                              ignore_eos=True, seed=3)])[0]
        assert set(out.versions) == {version}
        torch.testing.assert_close(torch.tensor(out.logprobs),
                                   forward_logprobs(models["w1"], prompt, out.token_ids, 1.0),
                                   atol=1e-4, rtol=1e-4)
    finally:
        backend.load(model_dirs["w0"])


def test_interruption_is_invisible(backend, models, model_dirs):
    """pause -> update_weights(path) -> resume while long greedy generations run: every completion
    is greedy decoding under w0 up to the switch and under w1 after it, each token tagged with its
    version, nothing lost or duplicated."""
    n = 300  # long enough for all five to be seen generating at once, however fast the engine
    reqs = [req(p, temperature=0, max_new_tokens=n, ignore_eos=True) for p in prompts(5)]
    v0 = backend.pool.version
    pool = backend.pool

    async def main():
        tasks = [asyncio.ensure_future(pool.generate(r)) for r in reqs]
        await asyncio.to_thread(backend.wait_generating, len(reqs), 2)
        await asyncio.to_thread(pool.pause)
        v1 = await asyncio.to_thread(backend.load, model_dirs["w1"])
        await asyncio.to_thread(pool.resume)
        return v1, await asyncio.gather(*tasks)

    try:
        v1, outs = asyncio.run(main())
    finally:
        pool.resume()
        backend.load(model_dirs["w0"])
    assert len(outs) == len(reqs)
    for r, out in zip(reqs, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == n
        k = out.versions.index(v1)
        assert 2 <= k < n
        assert set(out.versions[:k]) == {v0} and set(out.versions[k:]) == {v1}
        before = greedy_reference(models["w0"], r.input_ids, k)
        after = greedy_reference(models["w1"], [*r.input_ids, *before], n - k)
        assert list(out.token_ids) == before + after
        expected = torch.cat([forward_logprobs(models["w0"], r.input_ids, before, 1.0),
                              forward_logprobs(models["w1"], [*r.input_ids, *before], after, 1.0)])
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_a_cancelled_caller_cancels_its_request(backend):
    pool = backend.pool

    async def main():
        task = asyncio.ensure_future(pool.generate(req([3, 4, 5], temperature=0,
                                                       max_new_tokens=900, ignore_eos=True)))
        await asyncio.to_thread(backend.wait_generating, 1, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        pool.resume()
    wait_for(lambda: backend.held() == 0, what="the cancelled request to be dropped")
    after = generate_all(pool, [req([5, 6], temperature=0, max_new_tokens=3)])[0]
    assert len(after.token_ids) <= 3 and after.finish_reason != "abort"


def test_an_explicit_abort_returns_the_tokens_so_far(backend):
    pool = backend.pool
    if not hasattr(pool, "abort"):
        pytest.skip("this pool has no explicit abort(rid); cancellation is its only one")
    r = req([3, 4, 5], temperature=0, max_new_tokens=900, ignore_eos=True)

    async def main():
        task = asyncio.ensure_future(pool.generate(r))
        await asyncio.to_thread(backend.wait_generating, 1, 2)
        await asyncio.to_thread(pool.abort, r.rid)
        return await task

    try:
        out = asyncio.run(main())
    finally:
        pool.resume()
    assert out.finish_reason == "abort" and 2 <= len(out.token_ids) < 900
    assert len(out.logprobs) == len(out.versions) == len(out.token_ids)
