"""One GRPO training step at the default recipe's shape: the runtime's defaults, each saving
switched off in turn, and the runtime before them.

A batch of 2 prompts x 8 completions (prompts of 200 tokens, completions of 32 to 128, the
loss on the completions only; one of the two groups flat, as early GSM8K batches mostly are), one
optimizer
step of `TrainEngine.train` with GRPO, in the recipe's precision on this machine
(`runtime/precision.py`, measured). Each configuration runs in a process of its own, so its peak resident
memory is its own:
  before           the LM head and an fp32 log-softmax over the whole vocabulary at every
                   position (entropy everywhere), every row, foreach AdamW, glibc's default
                   mmap threshold, one 8,192-token micro-batch attending through the mask
  defaults         the RL recipes': log-probs only at the loss positions, chunked and
                   recomputed in backward, their log-softmax, entropy and gradient written out
                   in place (`logprobs.py`; off: autograd's chain under checkpointing); no forward/backward for rows whose advantages are all
                   zero; fused AdamW; freed tensors returned to the OS; rows packed end to end
                   (no padding; off: right-padded rows, micro-batches of length-sorted rows
                   under rows x longest <= the budget) into packs of up to 4,096 tokens, each
                   row attending on its own (`TrainConfig.packed_attention`; off: through the
                   pack's block-diagonal mask); the MLPs and norms compiled
                   (`TrainConfig.compile`, where a C++ compiler is), their backward
                   recomputing the MLP's product (`compiled_layers.ACTIVATION_BUDGET`; off:
                   the partitioner keeps it)
  - X              the defaults without X
  512-token mb ... the recipes' defaults before 2026-11-26: 512-token packs, the mask, eager
  + act. ckpt      the defaults with activation checkpointing
  2,048-token packs the defaults with packs of half the size (less memory, more steps' overhead)

    python benchmarks/train_step.py [--quick] [--out benchmarks/results/train_step.json]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import main, markdown_table  # noqa: E402

SAVINGS = ["loss positions", "written-out head", "skip flat rows", "fused AdamW",
           "freed memory", "packing", "row attention", "compile", "activation budget"]
CONFIGS = {  # name -> (savings on, tokens per micro-batch)
    "before": (set(), 8192),
    "defaults": (set(SAVINGS), 4096),
    **{f"- {x}": (set(SAVINGS) - {x}, 4096) for x in SAVINGS},
    # the recipes' defaults until 2026-11-26
    "512-token mb, - row attention - compile": (set(SAVINGS) - {"row attention", "compile"},
                                                 512),
    "+ act. ckpt": ({*SAVINGS, "act. ckpt"}, 4096),
    "2,048-token packs": (set(SAVINGS), 2048),
}


def batch(vocab: int, prompts: int = 2, group: int = 8, prompt_len: int = 200,
          new_tokens: int = 128):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    rows, width = prompts * group, prompt_len + new_tokens
    lengths = prompt_len + torch.randint(new_tokens // 4, new_tokens + 1, (rows,), generator=g)
    attention = torch.arange(width)[None, :] < lengths[:, None]
    loss_mask = attention.clone()
    loss_mask[:, :prompt_len] = False
    rewards = torch.rand(rows, generator=g)
    rewards[:group] = 0.0  # the first group is flat
    return TensorDict({
        "input_ids": torch.randint(3, vocab, (rows, width), generator=g),
        "attention_mask": attention, "loss_mask": loss_mask,
        "logprobs": -torch.rand(rows, width, generator=g) * loss_mask,
        "versions": torch.zeros(rows, width, dtype=torch.long),
        "rewards": rewards, "group_ids": torch.arange(rows) // group,
        "temperature": torch.ones(rows), "policy_version": torch.zeros(rows, dtype=torch.long),
    }, batch_size=[rows])


class PaddedRows:
    """The layout before packing: the right-padded rows as they are (`layout.PackedRows`'s
    interface), attention masked."""

    def __init__(self, ids, mask):
        self.ids, self.mask, self.lengths = ids, mask, mask.sum(1)
        self.input_ids = ids.flatten()[None]

    @classmethod
    def of(cls, ids, mask):
        return cls(ids, mask)

    def model_inputs(self):
        return {"input_ids": self.ids, "attention_mask": self.mask.long(), "use_cache": False}

    def index(self, rows, cols):
        return rows * self.ids.shape[1] + cols

    def unpack(self, values):
        return values


def padded_micro_batches(lengths, max_tokens):
    """Micro-batches before packing: first-fit decreasing under rows x longest row."""
    bins = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        for rows in bins:
            if (len(rows) + 1) * lengths[rows[0]] <= max_tokens:
                rows.append(row)
                break
        else:
            bins.append([row])
    return bins


def one(model: str, name: str, steps: int) -> dict:
    """Runs in its own process: seconds per step and peak RSS of one configuration."""
    import resource

    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import OptimizerConfig, PolicyLossConfig
    from areal_flow.runtime import engine as engine_module
    from areal_flow.runtime.distributed import shutdown_distributed
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from areal_flow.types import ModelOutput

    on, mb_tokens = CONFIGS[name]

    class FullHead(TrainEngine):
        def outputs(self, mb, entropy="metric"):
            ids, mask = mb["input_ids"], mb["attention_mask"]
            logits = self.model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float() / mb["temperature"][:, None, None], -1)
            pad = torch.nn.functional.pad
            token = pad(logp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
            return ModelOutput(logprobs=token, entropy=pad(-(logp.exp() * logp).sum(-1), (1, 0)))

    if "packing" not in on:
        engine_module.PackedRows = PaddedRows
        engine_module.micro_batches = padded_micro_batches
    if "written-out head" not in on:
        from torch.utils.checkpoint import checkpoint

        from areal_flow.runtime import logprobs

        def autograd_chain(hidden, weight, bias, targets, temperature, entropy):
            def chunk(hidden, weight, bias):
                logits = torch.nn.functional.linear(hidden, weight, bias).float()
                logp = torch.log_softmax(logits / temperature[:, None], -1)
                token = logp.gather(-1, targets[:, None]).squeeze(-1)
                with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                    return token, -(logp.exp() * logp).sum(-1)
            return checkpoint(chunk, hidden, weight, bias, use_reentrant=False) \
                if torch.is_grad_enabled() else chunk(hidden, weight, bias)

        logprobs._chunk = autograd_chain
    if "freed memory" not in on:
        engine_module._return_freed_memory = lambda: None
    if "activation budget" not in on:  # the partitioner keeps all it would
        from areal_flow.runtime import compiled_layers

        compiled_layers.ACTIVATION_BUDGET = 1.0
    engine = (TrainEngine if "loss positions" in on else FullHead)(model, TrainConfig(
        optim=OptimizerConfig(lr=1e-6), dtype="auto",
        max_tokens_per_mb=mb_tokens, packed_attention="row attention" in on,
        compile="on" if "compile" in on else "off",
        activation_checkpointing="act. ckpt" in on))
    if "fused AdamW" not in on:
        engine.optimizer = torch.optim.AdamW(engine.model.parameters(), lr=1e-6, foreach=True)
        engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda _: 1.0)
    algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False)))
    algorithm.skips_zero_advantage_rows = "skip flat rows" in on
    data = batch(engine.model.config.vocab_size)
    engine.train(data, algorithm)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        stats = engine.train(data, algorithm)
    seconds = (time.perf_counter() - start) / steps
    mfu = engine.mfu(stats["train/tokens"], seconds)  # over the GEMM rate of this model's shapes
    shutdown_distributed()
    return {"config": name, "seconds_per_step": seconds,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "skipped_rows": stats["train/skipped_rows"], "loss": stats["loss"], "mfu": mfu,
            "dtype": engine.precision.dtype}


def run(quick: bool = False) -> dict:
    from areal_flow.testing.tiny_model import build_tiny_model
    from benchmarks.engine import smollm2_sized

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": build_tiny_model(Path(tmp) / "tiny")}
        if not quick:
            models["smollm2-135m-shape"] = smollm2_sized(Path(tmp) / "smol")
        for model, path in models.items():
            for name in CONFIGS:
                out = subprocess.run([sys.executable, __file__, "--one", str(path), name,
                                      "5" if model == "tiny" else "3"],
                                     capture_output=True, text=True, check=True)
                rows.append({"model": model, **json.loads(out.stdout.splitlines()[-1])})
    return {"benchmark": "train_step", "rows": rows, "torch_threads": torch.get_num_threads(),
            "precision": "measured per model (runtime/precision.py)"}


def show(result: dict) -> None:
    print("one GRPO step, 2 prompts x 8 completions, 200 + 32..128 tokens, "
          f"{result.get('precision', 'bfloat16')}, {result['torch_threads']} threads; speed-up and "
          "memory against the runtime before these changes\n")
    base = {r["model"]: r for r in result["rows"] if r["config"] in ("before", "full head")}
    print(markdown_table(
        ["model", "configuration", "s/step", "speed-up", "MFU", "peak RSS GB", "skipped rows"],
        [[r["model"], r["config"], f"{r['seconds_per_step']:.2f}",
          f"{base[r['model']]['seconds_per_step'] / r['seconds_per_step']:.2f}x",
          f"{100 * r.get('mfu', float('nan')):.1f}%",
          f"{r['peak_rss_gb']:.2f}", f"{r['skipped_rows']:.0f}"] for r in result["rows"]]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        main(__doc__, run, show, "train_step")
