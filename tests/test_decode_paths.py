"""The engine's fast decode paths give what the plain ones give: KV slots written in place
(`kv_batch.SlotLayer`) and weights prepacked for oneDNN (`packed_weights`). The speed is in
`benchmarks/decode.py`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

from areal_flow.inference import kv_batch, packed_weights
from areal_flow.inference.local import LocalEngine
from tests.test_local_engine import assert_same_generations, group, perturbed, run_interrupted


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


@pytest.mark.skipif(not packed_weights.available(torch.bfloat16, torch.device("cpu")),
                    reason="this CPU's oneDNN has no bf16 kernels: nothing is packed")
def test_packed_weights_generate_what_plain_ones_do_and_follow_weight_updates(tiny_model_dir):
    """The run updates the weights mid-way: a packed copy left from before would keep
    generating from the old weights."""
    packed, engine = interrupted_run(tiny_model_dir, dtype="bfloat16", pack_weights=True)
    linears = [m for m in engine.model.modules() if type(m) is torch.nn.Linear]
    assert engine.pack_weights and linears
    assert all("forward" in m.__dict__ for m in linears)  # every layer read packed weights
    plain, engine = interrupted_run(tiny_model_dir, dtype="bfloat16", pack_weights=False)
    assert not any("forward" in m.__dict__ for m in engine.model.modules())
    assert_same_generations(packed, plain)


def test_packing_is_for_bf16_on_a_cpu_only():
    assert not packed_weights.available(torch.float32, torch.device("cpu"))
    assert not packed_weights.available(torch.bfloat16, torch.device("cuda"))
