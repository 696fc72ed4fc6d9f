"""The local engine against plain forward passes of the same weights."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from os.path import commonprefix

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_flow import generation_pools
from areal_flow.inference.local import LocalEngine
from areal_flow.types import GenerationRequest, SamplingParams, WeightUpdate


def request(prompt, **sampling) -> GenerationRequest:
    return GenerationRequest(input_ids=prompt, sampling=SamplingParams(**sampling))


def prompts(n: int, start: int = 10) -> list[list[int]]:
    """Prompts of different lengths, so the batch is ragged."""
    return [list(range(start + i, start + i + 3 + 2 * i)) for i in range(n)]


def forward_logprobs(model, prompt, tokens, temperature) -> torch.Tensor:
    """log_softmax(logits / T) at each generated token, from one full forward pass."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def greedy_reference(model, prompt, n) -> list[int]:
    """Greedy decoding without a KV cache: one full forward per token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def perturbed(model, scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def save_perturbed(model_dir, path, scale: float, seed: int):
    """A `save_pretrained` folder of `model_dir`'s model perturbed (other weights, same shape)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.load_state_dict(perturbed(model, scale, seed))
    model.save_pretrained(path)
    return path


@pytest.fixture
def engine(tiny_model_dir):
    # one per test (50 ms for the tiny model): each test then reaches the constructor, so a
    # mutation run credits every test that depends on what it sets up
    eng = LocalEngine(tiny_model_dir, max_batch_size=16)
    yield eng
    eng.close()


async def generate_all(engine, requests, stagger_at: int | None = None):
    """Submit `requests`; with `stagger_at`, submit the second half only after the engine has run
    that many steps, so they join a batch that is already decoding."""
    if stagger_at is None:
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    half = len(requests) // 2
    first = [asyncio.ensure_future(engine.generate(r)) for r in requests[:half]]
    joined = asyncio.Event()
    loop = asyncio.get_running_loop()
    steps = iter(range(1, 10_000))
    engine.on_step = lambda eng: next(steps) == stagger_at and loop.call_soon_threadsafe(joined.set)
    try:
        await asyncio.wait_for(joined.wait(), timeout=60)
        second = [asyncio.ensure_future(engine.generate(r)) for r in requests[half:]]
        return await asyncio.gather(*first, *second)
    finally:
        engine.on_step = None


def test_the_local_pool_is_registered_by_name():
    assert generation_pools.get("local") is LocalEngine


def test_logprobs_match_a_full_forward_pass_with_requests_joining_mid_batch(engine):
    reqs = [request(p, temperature=0.7, top_p=0.9, max_new_tokens=24, ignore_eos=True, seed=i)
            for i, p in enumerate(prompts(8))]
    outs = asyncio.run(generate_all(engine, reqs, stagger_at=5))
    for req, out in zip(reqs, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 24
        assert out.temperature == 0.7 and set(out.versions) == {0}
        assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        expected = forward_logprobs(engine.model, req.input_ids, out.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_greedy_requests_are_deterministic_in_a_mixed_batch(engine):
    greedy = [request(p, temperature=0.0, max_new_tokens=16, ignore_eos=True) for p in prompts(4)]
    alone = asyncio.run(generate_all(engine, greedy))
    sampled = [request(p, temperature=1.0, top_k=20, max_new_tokens=20, ignore_eos=True, seed=7)
               for p in prompts(4, start=40)]
    mixed = asyncio.run(generate_all(engine, [*sampled, *greedy]))
    for req, a, m in zip(greedy, alone, mixed[len(sampled):]):
        assert a.token_ids == m.token_ids
        assert list(a.token_ids) == greedy_reference(engine.model, req.input_ids, 16)
        assert a.temperature == 1.0  # greedy logprobs are reported at T = 1
    # sampled requests with a seed reproduce, whatever else is in the batch
    again = asyncio.run(generate_all(engine, sampled[:2]))
    assert [o.token_ids for o in again] == [o.token_ids for o in mixed[:2]]
    assert len({o.token_ids for o in mixed[: len(sampled)]}) > 1


def test_top_k_one_is_greedy_and_top_p_keeps_sampling_inside_the_nucleus(engine):
    prompt = prompts(1)[0]
    greedy = asyncio.run(engine.generate(request(prompt, temperature=0, max_new_tokens=12,
                                                 ignore_eos=True)))
    top1 = asyncio.run(engine.generate(request(prompt, temperature=1.3, top_k=1,
                                               max_new_tokens=12, ignore_eos=True, seed=3)))
    assert top1.token_ids == greedy.token_ids
    # the logprob is still the full-vocabulary one at T=1.3, not the truncated distribution's 0
    assert all(lp < 0 for lp in top1.logprobs)


def test_stop_tokens_eos_and_length_end_generation(engine):
    prompt = prompts(1)[0]
    free = asyncio.run(engine.generate(request(prompt, temperature=0, max_new_tokens=20,
                                               ignore_eos=True)))
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = asyncio.run(engine.generate(request(prompt, temperature=0, max_new_tokens=20,
                                                  ignore_eos=True, stop_token_ids=[stop_at])))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is kept
    eos = min(engine.eos_token_ids)
    engine.eos_token_ids, saved = {stop_at}, engine.eos_token_ids
    try:
        by_eos = asyncio.run(engine.generate(request(prompt, temperature=0, max_new_tokens=20)))
    finally:
        engine.eos_token_ids = saved
    assert by_eos.finish_reason == "stop" and by_eos.token_ids == stopped.token_ids
    assert free.finish_reason == "length" and eos is not None


def test_prompts_too_long_for_the_model_are_refused(engine):
    with pytest.raises(ValueError, match="exceeds the model's"):
        engine.submit(request([1] * engine.max_length, max_new_tokens=8))


def test_explicit_abort_returns_tokens_so_far(engine):
    async def main():
        req = request(prompts(1)[0], temperature=0, max_new_tokens=500, ignore_eos=True)
        steps = iter(range(1, 10_000))

        def hook(eng):
            if next(steps) == 6:
                eng.abort(req.rid)

        engine.on_step = hook
        try:
            out = await engine.generate(req)
        finally:
            engine.on_step = None
        return out

    out = asyncio.run(main())
    assert out.finish_reason == "abort" and 1 <= len(out.token_ids) < 500


def test_a_cancelled_caller_frees_its_slot_and_only_its_own(engine):
    async def main():
        task = asyncio.ensure_future(engine.generate(
            request(prompts(1)[0], temperature=0, max_new_tokens=900, ignore_eos=True)))
        other = asyncio.ensure_future(engine.generate(
            request(prompts(2)[1], temperature=0, max_new_tokens=60, ignore_eos=True)))
        started = threading.Event()
        engine.on_step = lambda eng: started.set()
        await asyncio.to_thread(started.wait, 60)
        engine.on_step = None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the engine drops the request and keeps serving, the other request included
        return await other, await engine.generate(request([5, 6, 7], temperature=0,
                                                          max_new_tokens=4))

    other, later = asyncio.run(main())
    assert other.finish_reason == "length" and len(other.token_ids) == 60
    assert len(later.token_ids) <= 4
    assert engine.stats()["running"] == 0


def test_closing_fails_the_requests_it_holds_and_sizes_of_one_are_allowed(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, max_batch_size=1, threads=1)
    engine.pause()
    held = engine.submit(request([5, 6, 7], temperature=0, max_new_tokens=4))
    engine.close()
    with pytest.raises(RuntimeError, match="the local engine was closed"):
        held.future.result(timeout=10)
    for bad in ({"max_batch_size": 0}, {"threads": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LocalEngine(tiny_model_dir, **bad)


def test_interrupted_generations_continue_under_the_new_weights(tiny_model_dir):
    check_interrupted_generations(tiny_model_dir, "cpu")


def check_interrupted_generations(tiny_model_dir, device: str) -> None:
    """w0 → w1 while long greedy generations run on `device`: each completion equals greedy
    decoding (on the CPU) under w0 up to the switch and under w1 after it, with every token's
    version recorded (tests/test_gpu.py runs it on CUDA)."""
    engine = LocalEngine(tiny_model_dir, device=device)
    w0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    w1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    w1.load_state_dict(perturbed(w0, 0.05, seed=1))
    switched = threading.Event()
    steps = iter(range(1, 10_000))

    def hook(eng):
        if next(steps) == 10:
            eng.pause(wait=False)
            switched.set()

    async def main():
        reqs = [request(p, temperature=0, max_new_tokens=30, ignore_eos=True) for p in prompts(5)]
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        await asyncio.to_thread(switched.wait, 60)
        await asyncio.to_thread(engine.update_weights,
                                WeightUpdate(version=1, state_dict=w1.state_dict()))
        engine.resume()
        return reqs, await asyncio.gather(*tasks)

    engine.on_step = hook
    try:
        reqs, outs = asyncio.run(main())
        stats = engine.stats()
        assert stats["interruptions"] == len(reqs)
    finally:
        engine.close()
    assert engine.version == 1
    for req, out in zip(reqs, outs):
        assert len(out.token_ids) == 30 and out.finish_reason == "length"
        k = out.versions.index(1)
        assert 0 < k and set(out.versions[:k]) == {0} and set(out.versions[k:]) == {1}
        before = greedy_reference(w0, req.input_ids, k)
        after = greedy_reference(w1, [*req.input_ids, *before], 30 - k)
        assert list(out.token_ids) == before + after
        expected = torch.cat([forward_logprobs(w0, req.input_ids, before, 1.0),
                              forward_logprobs(w1, [*req.input_ids, *before], after, 1.0)])
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)
    # the interruption's cost: each context (prompt + tokens under w0) is prefilled once more
    assert stats["reprefill_tokens"] == sum(len(r.input_ids) + o.versions.index(1)
                                            for r, o in zip(reqs, outs))


def test_an_update_between_hosted_steps_continues_the_rows_under_the_new_weights(tiny_model_dir):
    """The recipe's order: the trainer hosts the engine's steps, then, still hosting, trains and
    updates the weights (so no engine step runs between, to be interrupted). The update returns
    at once and the rows running then go on re-prefilled under w1: each completion is greedy
    decoding under w0 up to the update and under w1, from the whole context, after it."""
    engine = LocalEngine(tiny_model_dir)
    w0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    w1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    w1.load_state_dict(perturbed(w0, 0.05, seed=1))
    reqs = [request(p, temperature=0, max_new_tokens=20, ignore_eos=True) for p in prompts(3)]
    try:
        engine.pause()
        seqs = [engine.submit(r) for r in reqs]
        engine.resume()
        host_until_done(engine, seqs, steps_before_leaving=6)
        with engine.hosted():
            engine.step(timeout=0.01)  # a hosted step leaves the rows running
            switched_at = [len(s.tokens) for s in seqs]
            updater = threading.Thread(target=engine.update_weights, args=(
                WeightUpdate(version=1, state_dict=w1.state_dict()),))
            updater.start()  # as the trainer does on the hosting thread; a thread, to time out
            updater.join(timeout=30)
            assert not updater.is_alive(), "an update between hosted steps waited for a step"
            assert engine.stats()["interruptions"] == len(reqs)
            while not all(s.future.done() for s in seqs):
                engine.step(timeout=0.01)
        outs = [s.future.result(timeout=0) for s in seqs]
    finally:
        engine.close()
    for req, out, k in zip(reqs, outs, switched_at):
        assert 0 < k < 20 and list(out.versions) == [0] * k + [1] * (20 - k)
        before = greedy_reference(w0, req.input_ids, k)
        assert list(out.token_ids) == before + greedy_reference(w1, [*req.input_ids, *before],
                                                                20 - k)


def test_weights_load_from_a_state_dict_or_a_folder(tiny_model_dir, tmp_path):
    engine = LocalEngine(tiny_model_dir)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    other.load_state_dict(perturbed(other, 0.05, seed=2))
    other.save_pretrained(tmp_path)
    prompt = prompts(1)[0]
    try:
        for update in (WeightUpdate(version=3, path=str(tmp_path)),
                       WeightUpdate(version=4, state_dict=other.state_dict())):
            engine.update_weights(update)
            out = asyncio.run(engine.generate(request(prompt, temperature=0.8, max_new_tokens=10,
                                                      ignore_eos=True, seed=0)))
            assert set(out.versions) == {update.version} and engine.version == update.version
            torch.testing.assert_close(
                torch.tensor(out.logprobs),
                forward_logprobs(other, prompt, out.token_ids, 0.8), atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="do not fit the model"):
            engine.update_weights(WeightUpdate(version=5, state_dict={"nope": torch.zeros(1)}))
        assert engine.version == 4 and not engine.paused
    finally:
        engine.close()


def test_bf16_weights_generate_with_matching_logprobs(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, dtype="bfloat16")
    try:
        prompt = prompts(1)[0]
        out = asyncio.run(engine.generate(request(prompt, temperature=1.0, max_new_tokens=12,
                                                  ignore_eos=True, seed=1)))
        assert engine.model.dtype == torch.bfloat16
        expected = forward_logprobs(engine.model, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=2e-2, rtol=2e-2)
    finally:
        engine.close()


def test_stats_count_tokens_since_the_last_call(engine):
    engine.stats()
    began = time.perf_counter()
    asyncio.run(generate_all(engine, [request(p, temperature=0, max_new_tokens=7, ignore_eos=True)
                                      for p in prompts(3)]))
    stats = engine.stats()
    window = time.perf_counter() - began  # the window stats() measured, give or take its calls
    assert stats["generated_tokens"] == 21 and stats["finished"] == 3
    assert 0.5 * 21 / window < stats["tokens_per_s"] < 2 * 21 / window
    assert stats["running"] == 0 and stats["queued"] == 0
    assert engine.stats()["generated_tokens"] == 0


def test_stats_count_decode_steps_and_the_fraction_of_the_weight_read_bound(engine):
    engine.stats()
    outs = generate_together(engine, [request(p, temperature=0, max_new_tokens=7,
                                              ignore_eos=True) for p in prompts(3)])
    assert [len(o.token_ids) for o in outs] == [7, 7, 7]
    stats = engine.stats()
    assert stats["decode_steps"] == 6  # the prefill samples each first token
    # a step reads every weight once at least (a tied embedding is one tensor): it cannot
    # beat the weights' bytes over the bandwidth
    assert engine.weight_bytes == sum(p.numel() * p.element_size()
                                      for p in engine.model.parameters())
    assert 0 < stats["decode_mbu"] < 1
    assert engine.stats()["decode_steps"] == 0
    # the same fraction measured apart: the bound over the gaps between decode steps
    stamps = []
    engine.on_step = lambda _: stamps.append(time.perf_counter())
    try:
        generate_together(engine, [request(p, temperature=0, max_new_tokens=40, ignore_eos=True)
                                   for p in prompts(3)])
    finally:
        engine.on_step = None
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]  # after the first: decode steps only
    measured = engine.weight_bytes / engine.read_bandwidth / (sum(gaps) / len(gaps))
    assert 0.5 * measured < engine.stats()["decode_mbu"] < 2 * measured
    assert engine.stats()["decode_mbu"] == 0.0  # a window without decoding


def test_a_bucket_of_tensors_updates_only_those(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir)
    try:
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        name = "model.layers.0.mlp.down_proj.weight"
        bucket = {name: torch.ones_like(before[name])}
        engine.update_weights(WeightUpdate(version=0, state_dict=bucket))  # keeps the version
        after = engine.model.state_dict()
        assert torch.equal(after[name], bucket[name])
        assert all(torch.equal(after[k], v) for k, v in before.items() if k != name)
        with pytest.raises(ValueError, match="do not fit the model"):
            engine.update_weights(WeightUpdate(version=0, state_dict={name: torch.ones(3)}))
        assert engine.version == 0
    finally:
        engine.close()


def test_a_version_change_must_complete_the_weights(tiny_model_dir):
    """Buckets that keep the version accumulate; the one that changes it must leave no tensor
    of the model unsent since the last change (a tied tensor counts under either name); an empty
    update is refused."""
    engine = LocalEngine(tiny_model_dir)
    try:
        state = perturbed(engine.model, 0.05, seed=3)
        assert engine.model.config.tie_word_embeddings  # lm_head.weight is embed_tokens.weight
        norm = "model.norm.weight"
        missing = rf"missing names \['lm_head.weight', .*\({len(state) - 1} in all\)"
        with pytest.raises(ValueError, match=missing):
            engine.update_weights(WeightUpdate(version=1, state_dict={norm: state[norm]}))
        with pytest.raises(ValueError, match="no tensors"):
            engine.update_weights(WeightUpdate(version=0, state_dict={}))
        assert engine.version == 0
        rest = {n: t for n, t in state.items() if n not in (norm, "lm_head.weight")}
        engine.update_weights(WeightUpdate(version=0, state_dict=rest))
        engine.update_weights(WeightUpdate(version=1, state_dict={norm: state[norm]}))
        assert engine.version == 1
        loaded = engine.model.state_dict()
        assert all(torch.equal(loaded[n], t) for n, t in [*rest.items(), (norm, state[norm])])
        # the next version starts over: everything must come again
        with pytest.raises(ValueError, match=r"missing names \['lm_head.weight'"):
            engine.update_weights(WeightUpdate(version=2, state_dict={norm: state[norm]}))
        assert engine.version == 1
    finally:
        engine.close()


def test_the_device_is_cuda_when_there_is_one(monkeypatch):
    from areal_flow.config import InferenceConfig
    from areal_flow.inference.local import resolve_device

    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(InferenceConfig().device) == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(InferenceConfig().device) == torch.device("cpu")
    for bad in ("gpu", "cuda:x", "cuda:-1", "mps"):
        with pytest.raises(ValueError, match=r"'device' must be"):
            InferenceConfig(device=bad)


def test_from_config_passes_every_setting(monkeypatch):
    from areal_flow.config import InferenceConfig

    seen = {}
    monkeypatch.setattr(LocalEngine, "__init__",
                        lambda self, model, **kwargs: seen.update(kwargs, model=model))
    LocalEngine.from_config(InferenceConfig(device="cuda:1", max_batch_size=3, dtype="bfloat16"),
                            model="m", seed=11)
    assert seen["device"] == "cuda:1" and seen["max_batch_size"] == 3
    assert (seen["model"], seen["dtype"], seen["seed"]) == ("m", "bfloat16", 11)
    assert seen["threads"] is None  # the process's pool
    LocalEngine.from_config(InferenceConfig(device="cpu", threads=3), model="m")
    assert seen["threads"] == 3
    with pytest.raises(ValueError, match="threads"):
        InferenceConfig(threads=0)


def test_the_engine_thread_has_its_own_thread_count_and_the_callers_keeps_its_own(
        tiny_model_dir):
    process = torch.get_num_threads()
    engine = LocalEngine(tiny_model_dir, threads=process + 1)
    seen = []
    engine.on_step = lambda eng: seen.append(torch.get_num_threads())
    try:
        asyncio.run(engine.generate(request([5, 6, 7], max_new_tokens=3)))
    finally:
        engine.close()
    assert seen and set(seen) == {process + 1}
    # torch.set_num_threads on the engine thread would also be the count of every thread that
    # starts computing later (torch initialises a thread from its process-wide setting)
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert torch.get_num_threads() == process and later == [process]


def test_a_thread_count_without_an_openmp_runtime_warns(monkeypatch):
    from areal_flow.inference import local

    class NoOpenMP:
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(local.ctypes, "CDLL", lambda name: NoOpenMP())
    with pytest.warns(UserWarning, match="threads=2 has no effect"):
        local._set_thread_pool_size(2)


def test_an_abort_never_reaches_requests_submitted_after_it(engine):
    async def main():
        first = request(prompts(1)[0], temperature=0, max_new_tokens=400, ignore_eos=True)
        later = request(prompts(1)[0], temperature=0, max_new_tokens=5, ignore_eos=True)
        later = GenerationRequest(input_ids=later.input_ids, sampling=later.sampling,
                                  rid=first.rid)  # same id, submitted after the abort
        started = threading.Event()
        engine.on_step = lambda eng: started.set()
        task = asyncio.ensure_future(engine.generate(first))
        await asyncio.to_thread(started.wait, 60)
        engine.on_step = None
        engine.pause()  # the loop is parked: the abort stays pending until it runs again
        engine.abort(None)
        engine.abort(first.rid)
        second = asyncio.ensure_future(engine.generate(later))
        engine.resume()
        return await task, await second

    aborted, untouched = asyncio.run(main())
    assert aborted.finish_reason == "abort"
    assert untouched.finish_reason == "length" and len(untouched.token_ids) == 5


def test_set_version_relabels_new_tokens_and_starts_a_new_set_of_buckets(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir)
    try:
        engine.set_version(7)
        out = asyncio.run(engine.generate(request([3, 4], temperature=0, max_new_tokens=3)))
        assert set(out.versions) == {7}
        state = perturbed(engine.model, 0.05, seed=2)
        norm = "model.norm.weight"
        engine.update_weights(WeightUpdate(version=7, state_dict={norm: state[norm]}))
        rest = {n: t for n, t in state.items() if n != norm}
        engine.update_weights(WeightUpdate(version=8, state_dict=rest))  # completes version 8
        assert engine.version == 8
    finally:
        engine.close()


def test_an_update_naming_a_tensor_the_model_lacks_is_refused_and_changes_nothing(
        tiny_model_dir):
    engine = LocalEngine(tiny_model_dir)
    try:
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        state = perturbed(engine.model, 0.05, seed=2)
        state["_orig_mod.model.norm.weight"] = state["model.norm.weight"]  # a compiled model's
        with pytest.raises(ValueError, match=r"unexpected names \['_orig_mod.model.norm"):
            engine.update_weights(WeightUpdate(version=1, state_dict=state))
        assert engine.version == 0
        assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())
    finally:
        engine.close()


def test_interruptions_add_up_between_two_stats_calls(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir)
    try:
        engine.stats()
        for _ in range(2):  # two requests running, interrupted twice
            engine.pause()
            seqs = [engine.submit(request(p, temperature=0, max_new_tokens=200, ignore_eos=True))
                    for p in prompts(2)]
            engine.resume()
            while min(len(s.tokens) for s in seqs) < 2:
                time.sleep(0.001)
            engine.pause()
            engine.resume()
            [s.future.result(timeout=60) for s in seqs]
        assert engine.stats()["interruptions"] == 4
    finally:
        engine.close()


def test_rows_that_truncate_and_rows_that_do_not_sample_as_they_would_alone():
    """Only rows with top-k/top-p/min-p are truncated (the sort is skipped for the others);
    each row's token is the one it would draw in a batch of its own."""
    from areal_flow.inference.sampling import sample

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    # a greedy row first, so sampled rows' positions differ from their batch indices
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.5)]
    for seed in range(20):
        def generators():
            return [torch.Generator().manual_seed(seed + 100 * i) for i in range(len(params))]

        together, _ = sample(logits, params, generators())
        alone = [sample(logits[i:i + 1], [params[i]], [generators()[i]])[0].item()
                 for i in range(len(params))]
        assert together.tolist() == alone
        assert together[0] == logits[0].argmax() and together[1] == logits[1].argmax()


@pytest.fixture(scope="module")
def unshared(tiny_model_dir):
    eng = LocalEngine(tiny_model_dir, max_batch_size=16, share_prefix=False)
    yield eng
    eng.close()


def group(prompt, size, **sampling) -> list[GenerationRequest]:
    """A GRPO group: `size` requests with the same prompt and their own seeds."""
    return [request(prompt, seed=100 + i, ignore_eos=True, **sampling) for i in range(size)]


def generate_together(engine, requests):
    """Generate `requests` admitted in one prefill: submitted while the engine is paused."""
    engine.pause()
    seqs = [engine.submit(r) for r in requests]
    engine.resume()
    return [s.future.result(timeout=120) for s in seqs]


def assert_same_generations(outs, expected):
    for out, exp in zip(outs, expected, strict=True):
        assert out.token_ids == exp.token_ids and out.versions == exp.versions
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(exp.logprobs),
                                   atol=1e-5, rtol=0)


def test_a_group_prefills_its_prompt_once_and_samples_as_without_sharing(engine, unshared):
    a, b, c, d = list(range(30, 70)), list(range(100, 117)), [5, 6, 7], list(range(300, 340))
    reqs = [*group(a, 4, temperature=1.0, max_new_tokens=12),
            *group(b, 3, temperature=0.8, top_p=0.9, max_new_tokens=10),
            request(c, temperature=0, max_new_tokens=6),
            *group(d, 2, temperature=1.0, max_new_tokens=8)]  # as long as a: not a's group
    engine.stats()
    shared = generate_together(engine, reqs)
    stats = engine.stats()
    assert stats["prefill_tokens"] == len(a) + len(b) + len(c) + len(d)  # once per prompt
    assert stats["prefill_shared_tokens"] == 3 * len(a) + 2 * len(b) + len(d)
    unshared.stats()
    alone = generate_together(unshared, reqs)
    assert unshared.stats()["prefill_tokens"] == sum(len(r.input_ids) for r in reqs)
    assert_same_generations(shared, alone)
    assert len({o.token_ids for o in shared[:4]}) == 4  # each sample drew its own tokens


def run_interrupted(engine, w1, first, late, late_at=3, switch_at=8):
    """Generate `first` admitted together, `late` from step `late_at` on, switching to the
    weights `w1` after step `switch_at` (pause, update, resume)."""
    late_seqs, switched = [], threading.Event()
    steps = iter(range(1, 10_000))

    def hook(eng):
        step = next(steps)
        if step == late_at:
            late_seqs.extend(eng.submit(r) for r in late)
        if step == switch_at:
            eng.pause(wait=False)
            switched.set()

    engine.on_step = hook
    try:
        engine.pause()
        seqs = [engine.submit(r) for r in first]
        engine.resume()
        assert switched.wait(60)
        engine.update_weights(WeightUpdate(version=1, state_dict=w1))
        engine.stats()
        engine.resume()
        outs = [s.future.result(timeout=120) for s in [*seqs, *late_seqs]]
        return outs, engine.stats()
    finally:
        engine.on_step = None


def test_an_interrupted_group_reprefills_its_prompt_once_and_samples_as_without_sharing(
        tiny_model_dir):
    """Samples of a group resume with different tokens so far: the prompt (their longest common
    context) is prefilled once, then each sample's own tokens, of different lengths (one sample
    joined late), behind masked columns, and behind left padding for the shorter prompt's group.
    Tokens and logprobs equal those without sharing."""
    a, b = list(range(30, 60)), list(range(200, 211))
    samples = group(a, 4, temperature=1.0, max_new_tokens=24)
    first = [*samples[:3], *group(b, 2, temperature=0.9, max_new_tokens=20)]
    w1 = perturbed(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 0.05, seed=4)
    results = {}
    for share in (True, False):
        engine = LocalEngine(tiny_model_dir, share_prefix=share)
        try:
            results[share] = run_interrupted(engine, w1, first, samples[3:])
        finally:
            engine.close()
    (outs, stats), (expected, unshared_stats) = results[True], results[False]
    assert_same_generations(outs, expected)
    reqs = [*first, *samples[3:]]
    contexts = [[*r.input_ids, *o.token_ids[:o.versions.index(1)]] for r, o in zip(reqs, outs)]
    assert len({len(c) for c in contexts}) == 3  # a late sample, and a prompt of another length
    assert unshared_stats["reprefill_tokens"] == sum(map(len, contexts))
    lcp = [len(commonprefix([c for c, r in zip(contexts, reqs) if r.input_ids == tuple(prompt)]))
           for prompt in (a, b)]
    assert lcp[0] >= len(a) and lcp[1] >= len(b)
    saved = 3 * lcp[0] + lcp[1]  # the prompt once per group, not once per sample
    assert stats["reprefill_tokens"] == sum(map(len, contexts)) - saved
    assert stats["prefill_shared_tokens"] == saved


def test_sampled_tokens_follow_the_probabilities_and_stay_inside_the_truncation():
    from areal_flow.inference.sampling import sample

    n, logits = 20_000, torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0, 0.5])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=2)]
    tokens, _ = sample(logits.repeat(2 * n, 1), [p for p in params for _ in range(n)],
                       [torch.Generator().manual_seed(i) for i in range(2 * n)])
    full, top2 = (torch.bincount(t, minlength=6) / n for t in tokens.split(n))
    torch.testing.assert_close(full, torch.softmax(logits, -1), atol=0.015, rtol=0)
    expected = torch.zeros(6)
    expected[:2] = torch.softmax(logits[:2] / 0.5, -1)
    torch.testing.assert_close(top2, expected, atol=0.015, rtol=0)
    assert top2[2:].sum() == 0  # never a token outside the truncation


def kept(logits, **sampling) -> int:
    """How many tokens the sampler's truncation leaves possible for `logits`."""
    from areal_flow.inference.sampling import truncate

    out = truncate(torch.tensor([logits]), [SamplingParams(**sampling)])
    return int(torch.isfinite(out).sum())


def test_every_boundary_of_the_truncation():
    """Four equally likely tokens (probabilities 1/4, exact in float): the boundaries of top-k,
    top-p and min-p land exactly on a token."""
    four = [0.0] * 4 + [-math.inf] * 2
    # top-p as SGLang's sampler has it: a token is dropped only when the tokens ranked above it
    # hold more than top_p; mass exactly top_p above it keeps it
    assert [kept(four, top_p=p) for p in (0.2, 0.25, 0.3, 0.5, 0.75, 0.76, 1.0)] == \
        [1, 2, 2, 3, 4, 4, 4]
    assert [kept(four, top_k=k) for k in (1, 2, 3, 4, 5, -1)] == [1, 2, 3, 4, 4, 4]
    # min-p: a probability equal to min_p times the top one's stays
    assert [kept(four, min_p=m) for m in (0.0, 0.5, 1.0)] == [4, 4, 4]
    assert kept([0.0, 0.0, -1.0, -5.0], min_p=0.3) == 3  # e^-1 ≈ 0.37 ≥ 0.3 > e^-5
    # the floor is min_p times the top token's probability, not the runner-up's
    assert kept([0.0, -1.0, -1.5], min_p=0.5) == 1  # 0.5 > e^-1 ≈ 0.37: one left
    # the most likely token always survives, and the options combine (the smallest set wins)
    assert kept([0.0, -1.0, -2.0], top_p=1e-9) == 1
    assert kept(four, top_k=3, top_p=0.3) == 2 and kept(four, top_k=2, top_p=0.75) == 2


def test_only_rows_with_a_truncation_option_are_truncated():
    from areal_flow.inference.sampling import _truncates

    assert not _truncates(SamplingParams())
    assert [_truncates(SamplingParams(**o)) for o in
            ({"top_k": 1}, {"top_p": 0.99}, {"min_p": 0.01})] == [True, True, True]


def test_pause_returns_only_once_no_step_is_in_progress(engine):
    """What makes changing the weights after `pause()` safe."""
    busy, stepping = threading.Event(), threading.Event()

    def slow_step(eng):
        busy.set()
        stepping.set()
        time.sleep(0.3)
        busy.clear()

    engine.on_step = slow_step
    try:
        engine.submit(request([5, 6, 7], temperature=0, max_new_tokens=200, ignore_eos=True))
        assert stepping.wait(30)
        engine.pause()
        assert not busy.is_set()
    finally:
        engine.on_step = None
        engine.resume()


def test_auto_precision_is_measured_on_this_models_decode_shapes(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    engine = LocalEngine(tiny_model_dir, dtype="auto")
    try:
        chosen = engine.precision
        assert chosen.purpose == "decode" and set(chosen.seconds) == {"float32", "bfloat16"}
        assert chosen.shape[1:3] == (config.hidden_size, config.intermediate_size)
        assert engine.model.dtype == chosen.torch_dtype
    finally:
        engine.close()


def test_a_live_update_that_does_not_fit_the_engine_is_copied_not_kept(tiny_model_dir):
    """Kept tensors must be every tensor, in the engine's dtype: a bucket, or fp32 tensors for
    a bf16 engine, are copied in (and the engine's own tensors hold the new values)."""
    for dtype, update in (("float32", "bucket"), ("bfloat16", "whole")):
        engine = LocalEngine(tiny_model_dir, dtype=dtype)
        try:
            state = {k: t.float() for k, t in perturbed(engine.model, 0.05, seed=5).items()}
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # one tensor, tied
            if update == "bucket":
                state = {"model.norm.weight": state["model.norm.weight"]}
            kept = engine.update_weights(WeightUpdate(version=0, state_dict=state, live=True))
            assert kept is False and not engine.weights.shared
            own = engine.model.state_dict()
            for name, tensor in state.items():
                assert own[name].data_ptr() != tensor.data_ptr()
                torch.testing.assert_close(own[name].float(), tensor.to(own[name].dtype).float())
        finally:
            engine.close()


def test_every_boundary_of_what_a_request_may_hold(engine):
    vocab, positions = engine.vocab_size, engine.max_length
    engine.pause()
    try:
        engine.submit(request([0, vocab - 1], max_new_tokens=2, stop_token_ids=[0, vocab - 1]))
        engine.submit(request([1] * (positions - 8), max_new_tokens=8))  # exactly the positions
        for field, bad, where in (("input_ids", [0, vocab], 1), ("input_ids", [-1, 5], 0),
                                  ("stop_token_ids", [3, 4, vocab + 7], 2)):
            ids = {"input_ids": [5, 6]} | ({field: bad} if field == "input_ids" else {})
            sampling = {"stop_token_ids": bad} if field == "stop_token_ids" else {}
            with pytest.raises(ValueError, match=rf"'{field}' holds token id {bad[where]} at "
                                                 rf"position {where}, outside .*\[0, {vocab}\)"):
                engine.submit(request(ids["input_ids"], max_new_tokens=2, **sampling))
        with pytest.raises(ValueError, match="exceeds the model's"):
            engine.submit(request([1] * (positions - 7), max_new_tokens=8))
    finally:
        engine.abort()
        engine.resume()


def test_requests_without_a_seed_draw_from_the_engines_seeded_generator(tiny_model_dir):
    def unseeded(seed):
        engine = LocalEngine(tiny_model_dir, seed=seed)
        try:
            return [o.token_ids for o in generate_together(engine, [
                request(p, temperature=1.0, max_new_tokens=12, ignore_eos=True)
                for p in prompts(3)])]
        finally:
            engine.close()

    first, again, other = unseeded(3), unseeded(3), unseeded(4)
    assert first == again and first != other
    assert len({tuple(t) for t in first}) == 3


def test_prefill_counters_add_up_over_a_window(engine):
    engine.stats()
    a, b = list(range(30, 50)), list(range(100, 111))
    generate_together(engine, group(a, 3, temperature=1.0, max_new_tokens=3))
    generate_together(engine, group(b, 2, temperature=1.0, max_new_tokens=3))
    stats = engine.stats()
    assert stats["prefill_tokens"] == len(a) + len(b)
    assert stats["prefill_shared_tokens"] == 2 * len(a) + len(b)


def test_the_batch_never_exceeds_its_size(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, max_batch_size=2)
    sizes = []
    engine.on_step = lambda eng: sizes.append(len(eng._running))
    try:
        outs = generate_together(engine, [request(p, temperature=0, max_new_tokens=6,
                                                  ignore_eos=True) for p in prompts(5)])
    finally:
        engine.close()
    assert [len(o.token_ids) for o in outs] == [6] * 5 and max(sizes) == 2


def test_a_failing_forward_fails_its_requests_and_the_engine_keeps_serving(engine):
    forward = engine.model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (injected)")

    engine.model.forward = broken
    try:
        with pytest.raises(RuntimeError, match="injected"):
            generate_together(engine, [request(p, temperature=0, max_new_tokens=4)
                                       for p in prompts(2)])
    finally:
        engine.model.forward = forward
    out = asyncio.run(engine.generate(request([5, 6], temperature=0, max_new_tokens=3,
                                              ignore_eos=True)))
    assert len(out.token_ids) == 3 and engine.stats()["running"] == 0


def test_a_failing_abort_fails_the_running_requests_and_the_engine_keeps_serving(engine):
    """An abort that drops a running row rearranges the KV batch outside the step's own error
    handling; if that fails, the rows left cannot be trusted: they fail with the error, the
    aborted one still returns "abort", and the engine thread lives on (it died once, and every
    later request waited for ever)."""
    def broken(rows):
        raise RuntimeError("keep failed (injected)")

    def abort_b_once(eng):
        if len(eng._running) == 2:
            eng.on_step = None
            eng._kv.keep = broken
            eng.abort("b")

    engine.on_step = abort_b_once
    a, b = (engine.submit(GenerationRequest(
        input_ids=ids, rid=rid, sampling=SamplingParams(temperature=0, max_new_tokens=50,
                                                        ignore_eos=True)))
        for ids, rid in (([5, 6], "a"), ([7, 8], "b")))
    assert b.future.result(timeout=30).finish_reason == "abort"
    with pytest.raises(RuntimeError, match="injected"):
        a.future.result(timeout=30)
    del engine._kv.keep
    out = asyncio.run(engine.generate(request([5, 6], temperature=0, max_new_tokens=3,
                                              ignore_eos=True)))
    assert len(out.token_ids) == 3 and engine.stats()["running"] == 0


def test_a_completion_that_fails_to_decode_fails_alone(engine):
    """The text of an aborted request is decoded on the engine thread outside the step's
    error handling (a tokenizer can refuse ids: a padded vocabulary is larger than the
    tokenizer's); that request fails with the error and no other does."""
    decode, armed = engine.tokenizer.decode, []

    def refuses_once(ids, **kwargs):
        if armed and armed.pop():
            raise ValueError("id out of the tokenizer's range (injected)")
        return decode(ids, **kwargs)

    def abort_b_once(eng):
        if len(eng._running) == 2:
            eng.on_step = None
            armed.append(True)  # the next decode is b's, in the abort
            eng.abort("b")

    engine.tokenizer.decode = refuses_once
    engine.on_step = abort_b_once
    a, b = (engine.submit(GenerationRequest(
        input_ids=ids, rid=rid, sampling=SamplingParams(temperature=0, max_new_tokens=12,
                                                        ignore_eos=True)))
        for ids, rid in (([5, 6], "a"), ([7, 8], "b")))
    with pytest.raises(ValueError, match="injected"):
        b.future.result(timeout=30)
    assert len(a.future.result(timeout=30).token_ids) == 12


def test_aborting_one_request_leaves_the_first_one_running(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir)
    try:
        engine.pause()
        first = engine.submit(GenerationRequest(
            input_ids=[5, 6], rid="first",
            sampling=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)))
        other = engine.submit(GenerationRequest(
            input_ids=[7, 8], rid="other",
            sampling=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)))
        engine.abort("other")
        engine.resume()
        assert other.future.result(timeout=60).finish_reason == "abort"
        assert first.future.result(timeout=60).finish_reason == "length"
    finally:
        engine.close()


def host_until_done(engine, seqs, *, steps_before_leaving: int | None = None) -> list[str]:
    """Run the engine's steps on this thread until `seqs` finish (or, with
    `steps_before_leaving`, leave after that many steps); the names of the threads that
    stepped."""
    stepped: list[str] = []
    engine.on_step = lambda e: stepped.append(threading.current_thread().name)
    with engine.hosted() as hosted:
        assert hosted is engine and not engine._thread.is_alive()  # one stepping thread
        while not all(s.future.done() for s in seqs):
            if steps_before_leaving is not None and len(stepped) >= steps_before_leaving:
                break
            engine.step(timeout=0.01)
    engine.on_step = None
    return stepped


def test_hosted_steps_run_on_the_caller_and_generate_what_the_engine_thread_does(engine):
    reqs = [*group(list(range(30, 60)), 3, temperature=1.0, max_new_tokens=12),
            request([5, 6, 7], temperature=0.0, max_new_tokens=9, ignore_eos=True)]
    expected = generate_together(engine, reqs)
    engine.pause()
    seqs = [engine.submit(r) for r in reqs]
    engine.resume()
    stepped = host_until_done(engine, seqs)
    assert set(stepped) == {threading.current_thread().name} and len(stepped) >= 11
    assert_same_generations([s.future.result(timeout=0) for s in seqs], expected)
    assert engine._thread.is_alive()  # the engine thread steps again after
    assert generate_together(engine, reqs[:1])[0].token_ids == expected[0].token_ids


def test_requests_left_running_by_a_host_finish_on_the_engine_thread(engine):
    reqs = group(list(range(30, 50)), 2, temperature=1.0, max_new_tokens=20)
    expected = generate_together(engine, reqs)
    engine.pause()
    seqs = [engine.submit(r) for r in reqs]
    engine.resume()
    stepped = host_until_done(engine, seqs, steps_before_leaving=5)
    assert len(stepped) == 5 and not any(s.future.done() for s in seqs)
    assert_same_generations([s.future.result(timeout=60) for s in seqs], expected)


def test_an_abort_from_another_thread_ends_a_hosted_request(engine):
    seq = engine.submit(request(list(range(20, 40)), temperature=1.0, max_new_tokens=500,
                                ignore_eos=True, seed=1))
    threading.Timer(0.2, engine.abort, args=(seq.request.rid,)).start()
    host_until_done(engine, [seq])
    out = seq.future.result(timeout=0)
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 500


def test_steps_are_hosted_by_one_caller_at_a_time(engine):
    with pytest.raises(RuntimeError, match="within LocalEngine.hosted"):
        engine.step(timeout=0)
    with engine.hosted():
        with pytest.raises(RuntimeError, match="hosted by another caller"):
            with engine.hosted():
                pass
    assert engine._thread.is_alive()


def test_a_weight_update_leaves_a_paused_engine_paused(engine):
    """A trainer pauses, sends its weights in buckets, then resumes: an engine that resumed after
    the first bucket would sample on half-updated weights."""
    steps = []
    engine.on_step = lambda eng: steps.append(eng)
    engine.pause()
    try:
        future = engine.submit(request([5, 6, 7], temperature=0, max_new_tokens=4)).future
        state = perturbed(engine.model, 0.01, seed=3)
        names = sorted(state)
        half = len(names) // 2
        # the bucket that keeps the version, then the one that completes the new version
        for version, bucket in ((0, names[:half]), (1, names[half:])):
            engine.update_weights(WeightUpdate(version=version,
                                               state_dict={n: state[n] for n in bucket}))
            assert engine.paused
        time.sleep(0.2)  # an engine resumed by mistake would step in this time
        assert steps == [] and not future.done()
        engine.resume()
        assert future.result(timeout=30).finish_reason == "length"
        assert steps  # the request ran once resumed, on the new weights
        assert future.result().versions == (1, 1, 1, 1)
    finally:
        engine.on_step = None
        engine.resume()
