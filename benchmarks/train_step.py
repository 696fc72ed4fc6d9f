"""One GRPO training step at the default recipe's shape, with each training-side saving on/off.

A batch of 2 prompts x 8 completions (prompts ~200 tokens, completions 128, the loss on the
completions only; one of the two groups flat, as early GSM8K batches mostly are), one optimizer
step of `TrainEngine.train` with GRPO, bf16. Each configuration runs in a process of its own, so
its peak resident memory is its own:
  full head        the LM head and an fp32 log-softmax over the whole vocabulary at every
                   position, entropy everywhere (the runtime before the loss-position head)
  loss positions   log-probs only at the loss positions, chunked and recomputed in backward
  + skip flat      and no forward/backward for rows whose advantages are all zero

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

CONFIGS = {"full head": (False, False), "loss positions": (True, False),
           "loss positions + skip flat": (True, True)}


def batch(vocab: int, prompts: int = 2, group: int = 8, prompt_len: int = 200,
          new_tokens: int = 128):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    rows, width = prompts * group, prompt_len + new_tokens
    loss_mask = torch.zeros(rows, width, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    rewards = torch.rand(rows, generator=g)
    rewards[:group] = 0.0  # the first group is flat
    return TensorDict({
        "input_ids": torch.randint(3, vocab, (rows, width), generator=g),
        "attention_mask": torch.ones(rows, width, dtype=torch.bool), "loss_mask": loss_mask,
        "logprobs": -torch.rand(rows, width, generator=g) * loss_mask,
        "versions": torch.zeros(rows, width, dtype=torch.long),
        "rewards": rewards, "group_ids": torch.arange(rows) // group,
        "temperature": torch.ones(rows), "policy_version": torch.zeros(rows, dtype=torch.long),
    }, batch_size=[rows])


def one(model: str, name: str, steps: int) -> dict:
    """Runs in its own process: seconds per step and peak RSS of one configuration."""
    import resource

    from areal_flow.algorithms.grpo import GRPO, GRPOConfig
    from areal_flow.config import OptimizerConfig, PolicyLossConfig
    from areal_flow.runtime.distributed import shutdown_distributed
    from areal_flow.runtime.engine import TrainConfig, TrainEngine
    from areal_flow.types import ModelOutput

    loss_positions, skip = CONFIGS[name]

    class FullHead(TrainEngine):
        def outputs(self, mb, entropy="metric"):
            ids, mask = mb["input_ids"], mb["attention_mask"]
            logits = self.model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float() / mb["temperature"][:, None, None], -1)
            pad = torch.nn.functional.pad
            token = pad(logp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
            return ModelOutput(logprobs=token, entropy=pad(-(logp.exp() * logp).sum(-1), (1, 0)))

    engine = (TrainEngine if loss_positions else FullHead)(
        model, TrainConfig(optim=OptimizerConfig(lr=1e-6), bf16=True))
    algorithm = GRPO(GRPOConfig(loss=PolicyLossConfig(recompute_proximal=False)))
    algorithm.skips_zero_advantage_rows = skip
    data = batch(engine.model.config.vocab_size)
    engine.train(data, algorithm)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        stats = engine.train(data, algorithm)
    seconds = (time.perf_counter() - start) / steps
    shutdown_distributed()
    return {"config": name, "seconds_per_step": seconds,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "skipped_rows": stats["train/skipped_rows"], "loss": stats["loss"]}


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
                                      "5" if model == "tiny" else "2"],
                                     capture_output=True, text=True, check=True)
                rows.append({"model": model, **json.loads(out.stdout.splitlines()[-1])})
    return {"benchmark": "train_step", "rows": rows, "torch_threads": torch.get_num_threads()}


def show(result: dict) -> None:
    print("one GRPO step, 2 prompts x 8 completions, 200 + 128 tokens, bf16, "
          f"{result['torch_threads']} threads\n")
    base = {r["model"]: r for r in result["rows"] if r["config"] == "full head"}
    print(markdown_table(
        ["model", "configuration", "s/step", "speed-up", "peak RSS GB", "skipped rows"],
        [[r["model"], r["config"], f"{r['seconds_per_step']:.2f}",
          f"{base[r['model']]['seconds_per_step'] / r['seconds_per_step']:.2f}x",
          f"{r['peak_rss_gb']:.2f}", f"{r['skipped_rows']:.0f}"] for r in result["rows"]]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        main(__doc__, run, show, "train_step")
