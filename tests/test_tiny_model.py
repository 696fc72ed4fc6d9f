"""The offline tiny model fixture: small, loadable with plain transformers, chat-capable."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_model_loads_and_generates(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 1_000_000
    assert model.config.vocab_size == len(tokenizer)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert tokenizer.decode(prompt) == (
        "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(prompt) + 4)


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_any_text_round_trips_through_the_tokenizer(tiny_model_dir, text):
    tokenizer = _tokenizer(tiny_model_dir)
    assert tokenizer.decode(tokenizer.encode(text)) == text


_cache: dict = {}


def _tokenizer(path):
    if path not in _cache:
        _cache[path] = AutoTokenizer.from_pretrained(path)
    return _cache[path]
