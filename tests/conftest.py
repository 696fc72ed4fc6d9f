"""Shared fixtures. Anything that builds a model, installs a package or starts a server is
session-scoped, so the suite stays fast as it grows."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

pytest_plugins = ["pytester"]

# hypothesis's default 200 ms deadline per example is a wall-clock assertion: on a loaded
# 2-core machine test_overlong_penalty took 278 ms for one example and failed
settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A ~200k-parameter Llama + byte-level BPE tokenizer with a ChatML template."""
    from areal_flow.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory) -> Path:
    """24 GSM8K-shaped rows (question, worked answer ending in '#### N') the tiny model can fit."""
    import json

    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a in range(6) for b in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def example_plugin_path(tmp_path_factory) -> Path:
    """examples/plugins/reverse_task installed for real with pip into a folder of its own."""
    from tests.helpers import install_plugin

    return install_plugin("reverse_task", tmp_path_factory.mktemp("plugin_site"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (ChatML template, EOS <|im_end|>)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
