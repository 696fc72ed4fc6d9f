"""The engine's fast decode paths give what the plain ones give: KV slots written in place
(`kv_batch.SlotLayer`), weights prepacked for oneDNN (`packed_weights`) and the decode step
written out layer by layer (`decode_step`). The speed is in `benchmarks/decode.py`."""

from __future__ import annotations

import functools
import inspect
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

from areal_flow.inference import decode_step, grouped_attention, kv_batch, packed_weights
from areal_flow.inference.local import LocalEngine
from tests.test_local_engine import (assert_same_generations, generate_together, group, perturbed,
                                     run_interrupted)


def interrupted_run(model_dir, **options):
    """Groups of two prompt lengths, a sample joining late, and a weight update mid-run (the
    running rows are re-prefilled under it): every way rows enter and leave the KV batch."""
    a, b = list(range(30, 60)), list(range(200, 211))
    samples = group(a, 4, temperature=1.0, max_new_tokens=24)
    first = [*samples[:3], *group(b, 2, temperature=0.9, max_new_tokens=20)]
    w1 = perturbed(AutoModelForCausalLM.from_pretrained(model_dir), 0.05, seed=4)
    engine = LocalEngine(model_dir, **options)
    try:
        return run_interrupted(engine, w1, first, samples[3:])[0], engine
    finally:
        engine.close()


@pytest.mark.parametrize("grow", [1, kv_batch.GROW])
def test_kv_slots_generate_what_concatenation_does(tiny_model_dir, monkeypatch, grow):
    """grow=1: the buffers fill up and grow (double) many times within the run."""
    monkeypatch.setattr(kv_batch, "GROW", grow)
    slots, _ = interrupted_run(tiny_model_dir, kv_slots=True)
    concatenated, _ = interrupted_run(tiny_model_dir, kv_slots=False)
    assert_same_generations(slots, concatenated)


@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12), grow=st.integers(1, 5))
def test_a_slot_layer_holds_what_a_dynamic_layer_holds(chunks, grow):
    old, kv_batch.GROW = kv_batch.GROW, grow
    try:
        slot, dynamic = kv_batch.SlotLayer(), DynamicLayer()
        g = torch.Generator().manual_seed(len(chunks))
        for n in chunks:
            keys = torch.randn(2, 3, n, 4, generator=g)
            values = torch.randn(2, 3, n, 4, generator=g)
            got, expected = slot.update(keys, values), dynamic.update(keys, values)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert slot.get_seq_length() == sum(chunks)
    finally:
        kv_batch.GROW = old


def test_a_slot_layer_writes_in_place_until_full_then_doubles():
    """What slots are for: a decode step's column goes into the buffers as they are (no copy)
    until they are exactly full; then they grow to twice the length, once."""
    slot = kv_batch.SlotLayer()
    slot.update(torch.zeros(2, 3, 10, 4), torch.zeros(2, 3, 10, 4))  # a prefill of 10
    room, buffer = 10 + kv_batch.GROW, slot._room_keys.data_ptr()
    for length in range(11, room + 1):
        slot.update(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))
        assert slot._room_keys.data_ptr() == buffer, f"reallocated at length {length}"
    assert slot._room_keys.shape[-2] == room
    slot.update(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))  # one more than there is room
    assert slot._room_keys.shape[-2] == 2 * room and slot.get_seq_length() == room + 1


def sliding_config():
    """A Qwen2-shaped config whose second layer attends through a sliding window."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                       num_hidden_layers=2, intermediate_size=16, vocab_size=32,
                       use_sliding_window=True, sliding_window=4, max_window_layers=1,
                       layer_types=["full_attention", "sliding_attention"])


def test_the_kv_batch_uses_slots_by_default_for_plain_layers_only():
    """Slot layers replace transformers' plain ones (by default, and not with slots off); a
    sliding-window layer, which the model's config asks for, stays transformers' own."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layers = [(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))] * 2
    batch = kv_batch.KVBatch(sliding_config())
    assert len(batch) == 0  # nothing running yet
    assert [type(x) for x in batch.wrap(layers).layers] == [kv_batch.SlotLayer,
                                                            DynamicSlidingWindowLayer]
    plain = kv_batch.KVBatch(sliding_config(), slots=False).wrap(layers)
    assert [type(x) for x in plain.layers] == [DynamicLayer, DynamicSlidingWindowLayer]


def test_keeping_rows_drops_the_padding_columns_none_of_them_needs():
    """A long row finishing leaves the short ones' left padding: it is cut, so the cache does
    not keep the longest row's width for the rest of the batch's life."""
    batch = kv_batch.KVBatch(sliding_config())
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    keys = torch.arange(3 * 5, dtype=torch.float).reshape(3, 1, 5, 1).expand(3, 1, 5, 4)
    cache = kv_batch.KVBatch(sliding_config(), slots=False).wrap([(keys, keys), (keys, keys)])
    batch.append(cache, mask)
    batch.keep([1, 2])
    assert batch.mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert torch.equal(batch.cache.layers[0].keys, keys[1:, :, 2:])


def test_the_kv_caches_bytes_count_each_room_once_and_keep_a_kept_rows_room():
    """`KVBatch.nbytes` (the recipe's memory/kv_cache_gb): keys and values of every layer, each
    storage once; rows kept in place leave their slot room allocated, and it says so."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                         num_hidden_layers=2, intermediate_size=16, vocab_size=32)
    batch = kv_batch.KVBatch(config)
    assert batch.nbytes() == 0
    mask = torch.ones(3, 5, dtype=torch.long)
    layers = [(torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)) for _ in range(2)]
    batch.append(kv_batch.KVBatch(config, slots=False).wrap(layers), mask)
    rooms = [layer._room_keys.numel() for layer in batch.cache.layers]  # slots: room to grow
    assert batch.nbytes() == 2 * sum(rooms) * 4 and sum(rooms) >= 2 * 3 * 2 * 5 * 4
    batch.keep([0, 2])  # in place: the room stays, its view narrows
    assert batch.cache.layers[0].keys.shape[0] == 2
    assert batch.nbytes() == 2 * sum(rooms) * 4
    batch.clear()
    assert batch.nbytes() == 0


def test_left_padded_rows_give_integer_positions_a_position_table_can_take():
    """Models with learned positions (GPT-2's `wpe`) index a table with the positions: the ids
    and the mask they come from are integers, the pads are the pad id."""
    ids, mask = kv_batch.left_padded([[5, 6, 7], [8]], pad_token_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    table = torch.nn.Embedding(4, 2)
    assert table(kv_batch.positions(mask)).shape == (2, 3, 2)  # a float index would raise
    assert table(ids.clamp(max=3)).shape == (2, 3, 2)


def test_grouped_attention_generates_what_transformers_sdpa_does(tiny_model_dir):
    """Greedy tokens are the same and log-probs agree to float rounding, on left-padded rows
    of several lengths decoded together (masked attention over KV slot views)."""
    from areal_flow.types import GenerationRequest, SamplingParams

    results = {}
    for grouped in (True, False):
        engine = LocalEngine(tiny_model_dir, grouped_attention=grouped, max_batch_size=8)
        assert engine.grouped_attention == grouped
        assert (engine.model.config._attn_implementation == grouped_attention.NAME) == grouped
        requests = [GenerationRequest(input_ids=list(range(30 + 5 * i, 60 + 5 * i - 4 * i)),
                                      sampling=SamplingParams(temperature=0.0,
                                                              max_new_tokens=20,
                                                              ignore_eos=True))
                    for i in range(6)]
        try:
            results[grouped] = generate_together(engine, requests)
        finally:
            engine.close()
    for on, off in zip(results[True], results[False], strict=True):
        assert on.token_ids == off.token_ids
        torch.testing.assert_close(torch.tensor(on.logprobs), torch.tensor(off.logprobs),
                                   atol=1e-4, rtol=0)


def test_grouped_attention_is_for_a_cpu_and_matches_sdpa_on_a_padded_cached_batch(
        tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    assert grouped_attention.available(model, torch.device("cpu"))
    assert not grouped_attention.available(model, torch.device("cuda"))
    grouped = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    grouped_attention.use(grouped)
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    outs = []
    with torch.no_grad():
        for net in (model, grouped):
            first = net(input_ids=ids, attention_mask=mask, position_ids=kv_batch.positions(mask),
                        use_cache=True)
            # the KV cache as this transformers names it (`cache` from 5.24, as the engine does)
            name = "cache" if "cache" in inspect.signature(net.forward).parameters \
                else "past_key_values"
            step = net(input_ids=torch.tensor([[11], [12]]), attention_mask=step_mask,
                       position_ids=step_mask.sum(1, keepdim=True) - 1,
                       use_cache=True, **{name: getattr(first, name)})
            outs.append((first.logits, step.logits))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_generate_what_plain_ones_do_and_follow_weight_updates(tiny_model_dir,
                                                                             dtype):
    """The run updates the weights mid-way: a packed copy left from before would keep
    generating from the old weights. bf16: bit for bit; fp32: the same tokens, log-probs
    within float rounding (oneDNN sums in another order than `F.linear`)."""
    if not packed_weights.available(getattr(torch, dtype), torch.device("cpu")):
        pytest.skip(f"this CPU's oneDNN has no {dtype} kernels: nothing is packed")
    packed, engine = interrupted_run(tiny_model_dir, dtype=dtype, pack_weights=True)
    linears = [m for m in engine.model.modules() if type(m) is torch.nn.Linear]
    assert engine.pack_weights and linears
    assert all("forward" in m.__dict__ for m in linears)  # every layer read packed weights
    plain, engine = interrupted_run(tiny_model_dir, dtype=dtype, pack_weights=False)
    assert not any("forward" in m.__dict__ for m in engine.model.modules())
    assert_same_generations(packed, plain)


@pytest.mark.skipif(not packed_weights.available(torch.bfloat16, torch.device("cpu")),
                    reason="this CPU's oneDNN has no bf16 kernels: nothing is packed")
def test_packed_siblings_give_each_layer_its_own_product_of_the_input_it_was_given():
    """Query, key and value packed as one product: each layer returns what it alone would, one
    product serves all three calls on one input, a call on another input never gets the last
    input's product, and no product stays held once every layer has taken its slice."""
    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(48, n, bias=True, dtype=torch.bfloat16) for n in (48, 16, 16)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
    attention = torch.nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj = layers
    assert packed_weights.pack(attention) == 3
    together = packed_weights.siblings(attention)
    products = []
    real = together.product
    together.product = lambda x: products.append(x) or real(x)

    def alone(layer, x):
        return torch.nn.functional.linear(x, layer.weight, layer.bias)

    with torch.no_grad():
        for rows in (1, 8):  # decode's row counts: bit for bit
            x, other = (torch.randn(rows, 1, 48, generator=g).bfloat16() for _ in range(2))
            products.clear()
            for layer in layers:
                assert torch.equal(layer(x), alone(layer, x))
            assert len(products) == 1  # one product for the three
            assert together._product is None  # dropped once every layer took its slice
            q = layers[0](x)
            k = layers[1](other)  # another input while q's product is held
            assert torch.equal(k, alone(layers[1], other))
            assert torch.equal(q, alone(layers[0], x))
        q, k, v = together.parts(x)
        assert torch.equal(torch.cat([q, k, v], -1), together.product(x))
        assert torch.equal(v, alone(layers[2], x))
    packed_weights.unpack(attention)
    assert packed_weights.siblings(attention) is None
    assert not any("forward" in layer.__dict__ for layer in layers)


@pytest.mark.skipif(not packed_weights.available(torch.bfloat16, torch.device("cpu")),
                    reason="this CPU's oneDNN has no bf16 kernels: nothing is packed")
def test_a_bf16_engine_packs_each_layers_siblings_together(tiny_model_dir):
    engine = LocalEngine(tiny_model_dir, dtype="bfloat16")
    try:
        for layer in engine.model.model.layers:
            assert packed_weights.siblings(layer.self_attn) is not None
            assert packed_weights.siblings(layer.mlp) is not None
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_decode_step_generates_what_transformers_forward_does(tiny_model_dir, dtype,
                                                                       monkeypatch):
    """Bit for bit with torch's attention kernel: the same tokens and the same log-probs,
    through rows of two prompt lengths (masked attention), a row joining late and a weight
    update mid-run (in bf16 on this CPU the layers read packed weights, repacked after it)."""
    monkeypatch.setattr(decode_step, "faster_attention", lambda *shape: "sdpa")
    fused, engine = interrupted_run(tiny_model_dir, dtype=dtype)  # the default
    assert engine._decode_step is not None  # on a CPU for a Llama model
    assert engine._decode_step.attention == "sdpa"
    plain, engine = interrupted_run(tiny_model_dir, dtype=dtype, fused_decode=False)
    assert engine._decode_step is None
    for a, b in zip(fused, plain, strict=True):
        assert (a.token_ids, a.logprobs, a.versions) == (b.token_ids, b.logprobs, b.versions)


def test_the_fused_decode_step_with_matmul_attention_generates_what_transformers_does(
        tiny_model_dir, monkeypatch):
    """fp32, where the two attentions differ by float rounding only: the same sampled tokens
    (masked rows, a late row, a weight update mid-run) and log-probs to 1e-5."""
    monkeypatch.setattr(decode_step, "faster_attention", lambda *shape: "matmul")
    fused, engine = interrupted_run(tiny_model_dir, dtype="float32")
    assert engine._decode_step.attention == "matmul"
    plain, _ = interrupted_run(tiny_model_dir, dtype="float32", fused_decode=False)
    assert_same_generations(fused, plain)


def reference_attention(q, k, v, attend, scale):
    """Written apart, in float64: every query head against its key head, one row at a time."""
    rows, heads, _, dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(rows, heads, 1, dim, dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            scores = (k[r, h // group].double() @ q[r, h, 0].double()) * scale
            if attend is not None:
                scores[~attend[r, 0, 0]] = float("-inf")
            out[r, h, 0] = torch.softmax(scores, 0) @ v[r, h // group].double()
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 5), kv_heads=st.integers(1, 3),
       group=st.integers(1, 3), dim=st.sampled_from([4, 8, 16]), keys=st.integers(1, 40),
       padded=st.booleans(), bf16=st.booleans())
def test_matmul_attention_is_grouped_query_attention_with_masked_keys_ignored(
        seed, rows, kv_heads, group, dim, keys, padded, bf16):
    """Against a float64 reference written apart: grouped heads read their own key head, the
    masked (left-padding) keys get no weight even when their values are huge, and bf16 stays
    within bf16's rounding of the inputs. The keys are a strided view, as KV slots give."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    q = torch.randn(rows, kv_heads * group, 1, dim, generator=g).to(dtype)
    room = torch.randn(2, rows, kv_heads, keys + 3, dim, generator=g).to(dtype)
    k, v = room[0, :, :, :keys], room[1, :, :, :keys]
    attend = None
    if padded:
        pads = torch.randint(0, keys, (rows,), generator=g)  # each row keeps >= 1 key
        attend = (torch.arange(keys)[None] >= pads[:, None])[:, None, None, :]
        v = v.masked_fill(~attend.transpose(-1, -2), 1e4)  # the padding's values: huge
    scale = dim ** -0.5
    got = decode_step.matmul_attention(q, k, v, attend, scale)
    assert got.dtype == dtype and got.shape == q.shape
    expected = reference_attention(q, k, v, attend, scale)
    torch.testing.assert_close(got.double(), expected, atol=2e-2 if bf16 else 1e-5, rtol=0)


def test_matmul_attention_is_chosen_only_where_it_is_clearly_faster(monkeypatch):
    """A fake clock: each attention's call costs what the test says. Chosen below `MARGIN` of
    sdpa's time; at equal times (or just under) the kernel that matches transformers stays."""
    clock = [0.0]
    monkeypatch.setattr(decode_step.time, "perf_counter", lambda: clock[0])

    def costing(seconds):
        def attention(*args):
            clock[0] += seconds
        return attention

    for sdpa, matmul, chosen in [(1.0, 0.5, "matmul"), (1.0, 1.0, "sdpa"), (1.0, 0.9, "sdpa"),
                                 (0.5, 1.0, "sdpa")]:
        monkeypatch.setattr(decode_step, "ATTENTION", {"sdpa": costing(sdpa),
                                                       "matmul": costing(matmul)})
        assert decode_step.faster_attention.__wrapped__(torch.float32, 4, 2, 8, rows=3) == chosen


def test_the_attention_is_measured_once_a_process_for_each_shape(monkeypatch):
    """Two engines of one model in a process decode alike: the second takes the first's choice
    even where a new timing would choose the other (here: a clock that makes sdpa slow)."""
    decode_step.faster_attention.cache_clear()
    try:
        first = decode_step.faster_attention(torch.float32, 4, 2, 8, 3)
        clock = [0.0]
        monkeypatch.setattr(decode_step.time, "perf_counter", lambda: clock[0])
        costs = {"sdpa": 1.0, "matmul": 0.1} if first == "sdpa" else {"sdpa": 0.1, "matmul": 1.0}
        monkeypatch.setattr(decode_step, "ATTENTION", {
            name: (lambda *args, cost=cost: clock.__setitem__(0, clock[0] + cost))
            for name, cost in costs.items()})
        assert decode_step.faster_attention(torch.float32, 4, 2, 8, 3) == first
        assert decode_step.faster_attention(torch.float32, 4, 2, 8, 5) != first  # a new shape
    finally:
        decode_step.faster_attention.cache_clear()  # no fake clock's choice stays behind


def test_a_decode_step_takes_the_attention_it_is_given_or_the_measured_one(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert decode_step.DecodeStep(model, attention="matmul").attention == "matmul"
    assert decode_step.DecodeStep(model).attention in decode_step.ATTENTION


def test_the_fused_decode_step_is_for_llama_family_models_on_a_cpu(tiny_model_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert decode_step.supports(llama, torch.device("cpu"))
    assert not decode_step.supports(llama, torch.device("cuda"))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    assert not decode_step.supports(gpt2, torch.device("cpu"))
    llama.model.layers[0].mlp.act_fn = torch.nn.GELU()  # another MLP: transformers' forward
    assert not decode_step.supports(llama, torch.device("cpu"))


@pytest.mark.skipif(not packed_weights.available(torch.float32, torch.device("cpu")),
                    reason="this CPU's oneDNN packs no fp32 weights")
def test_fp32_packs_where_timed_faster_and_bf16_always(tiny_model_dir, monkeypatch):
    """fp32 packing is chosen by timing packed products against `F.linear` at the model's hidden
    size by MLP width (a fake packed product, slow or instant, decides it here); bf16 is never
    timed; `pack_weights=True` packs whatever the timing says."""
    import time as time_module

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    real, probe = packed_weights.linear, packed_weights.fp32_pays
    monkeypatch.setattr(packed_weights, "fp32_pays", functools.cache(probe.__wrapped__))
    for slow, expected in ((True, False), (False, True)):
        def fake(weight, bias=None, slow=slow):  # 2 ms a call, or nothing computed at all
            forward = real(weight, bias)
            return (lambda x: (time_module.sleep(0.002), forward(x))[1]) if slow else \
                (lambda x: x)

        monkeypatch.setattr(packed_weights, "linear", fake)
        packed_weights.fp32_pays.cache_clear()  # the fake's timings stay in this test
        assert packed_weights.pays(model) is expected
    monkeypatch.setattr(packed_weights, "fp32_pays", lambda *shape: False)
    assert packed_weights.pays(model.to(torch.bfloat16))
    engines = [LocalEngine(tiny_model_dir, pack_weights=pack) for pack in (None, True)]
    try:
        assert [e.pack_weights for e in engines] == [False, True]
    finally:
        for e in engines:
            e.close()


def test_packing_is_for_fp32_and_bf16_on_a_cpu_only():
    assert packed_weights.available(torch.float32, torch.device("cpu")) == \
        torch.backends.mkldnn.is_available()
    assert not packed_weights.available(torch.float16, torch.device("cpu"))
    assert not packed_weights.available(torch.float32, torch.device("cuda"))
    assert not packed_weights.available(torch.bfloat16, torch.device("cuda"))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 6), vocab=st.sampled_from([7, 300, 5000]),
       scale=st.floats(0.1, 20), bf16=st.booleans())
def test_the_sampler_is_the_inverse_cdf_of_each_rows_uniform_and_logs_log_softmax(
        seed, rows, vocab, scale, bf16):
    """Against a float64 reference written apart: each sampled token is where the row's own
    uniform falls in the cumulative probabilities (up to the float32 rounding of the running
    sum), greedy rows take the argmax, and the log-prob is log_softmax(logits / T) there."""
    from areal_flow.inference.sampling import sample
    from areal_flow.types import SamplingParams

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits = logits.to(torch.bfloat16) if bf16 else logits
    params = [SamplingParams(temperature=(0.0, 0.7, 1.0, 1.3)[(seed + i) % 4], max_new_tokens=1)
              for i in range(rows)]
    tokens, logprobs = sample(logits, params, [torch.Generator().manual_seed(seed + i)
                                               for i in range(rows)])
    for i, p in enumerate(params):
        row = logits[i].double() / p.logprob_temperature
        reference = torch.log_softmax(row, -1)
        assert abs(logprobs[i].item() - reference[tokens[i]].item()) < 1e-4
        if p.greedy:
            assert tokens[i] == logits[i].float().argmax()
            continue
        u = torch.rand(1, generator=torch.Generator().manual_seed(seed + i)).double().item()
        cdf = reference.exp().cumsum(-1)
        below = cdf[tokens[i] - 1].item() if tokens[i] > 0 else 0.0
        slack = 1e-5  # float32 running sums over up to 5000 entries
        assert below - slack <= u * cdf[-1].item() < cdf[tokens[i]].item() + slack
        assert reference[tokens[i]] > -float("inf")


def test_a_uniform_rounded_up_to_the_total_takes_the_last_token_with_a_weight(monkeypatch):
    """u < 1, but u·total can round to the total, above every entry of the CDF: each such row
    takes its own last token with a weight (the first row's only one is token 0)."""
    from areal_flow.inference import sampling
    from areal_flow.types import SamplingParams

    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.ones(1))
    inf = float("inf")
    logits = torch.tensor([[0.0, -inf, -inf, -inf, -inf], [0.0, 1.0, 2.0, -inf, -inf]])
    tokens, logprobs = sampling.sample(logits, [SamplingParams(temperature=1.0)] * 2, [None] * 2)
    assert tokens.tolist() == [0, 2]
    assert logprobs.tolist() == pytest.approx(
        [0.0, torch.log_softmax(logits, -1)[1, 2].item()], abs=1e-6)


def test_a_uniform_of_zero_never_takes_a_token_without_weight(monkeypatch):
    """u = 0 (drawn once in 2^24): u·total is 0, where the CDF is flat over the leading tokens
    that the logits or the truncation ruled out; the first token with a weight is taken."""
    from areal_flow.inference import sampling
    from areal_flow.types import SamplingParams

    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.zeros(1))
    logits = torch.tensor([[-float("inf"), -float("inf"), 0.0, 1.0], [1.0, 0.0, 3.0, 2.0]])
    tokens, _ = sampling.sample(logits, [SamplingParams(temperature=1.0),
                                         SamplingParams(temperature=1.0, top_k=2)], [None] * 2)
    assert tokens.tolist() == [2, 2]  # row 2's top-2 are tokens 2 and 3


def test_truncated_rows_sample_as_untruncated_ones_at_large_logits():
    """A truncated row's weights are exp(logit - max), as the others': at logits in the
    hundreds, exp(logit) alone overflows float32."""
    from areal_flow.inference.sampling import sample
    from areal_flow.types import SamplingParams

    logits = torch.tensor([[300.0, 299.0, 298.0, 0.0]] * 2)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3)]
    for seed in range(30):
        tokens, _ = sample(logits, params, [
            torch.Generator().manual_seed(seed) for _ in params])
        assert tokens[0] == tokens[1] and tokens[1] in (0, 1, 2), tokens


def test_top_p_one_keeps_every_token_whatever_the_float32_running_sum():
    """With top_p = 1 (off) on a row another option truncates, a token is never dropped for
    the mass above it: float32 sums of probabilities can exceed 1 before the last token."""
    from areal_flow.inference.sampling import truncate
    from areal_flow.types import SamplingParams

    found = 0
    for seed in range(200):
        logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(seed)) * 3
        logits[0, -1] = -40.0  # a token of tiny probability, ranked last
        ranked = torch.softmax(logits, -1).sort(descending=True).values
        if not ((ranked.cumsum(-1) - ranked) > 1).any():
            continue  # this row's running sum stays at or below 1
        found += 1
        out = truncate(logits, [SamplingParams(top_k=100, top_p=1.0)])
        assert torch.isfinite(out).all()
    assert found > 0  # rows where the sum passes 1 exist, so the check above ran
