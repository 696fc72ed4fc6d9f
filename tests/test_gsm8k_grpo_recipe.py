"""recipes/gsm8k_grpo.py end to end on the tiny model: one process, two torchrun ranks, launched
SGLang-protocol servers; exact resume after a SIGTERM; clear errors for bad input."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, assert_finite, metrics, run_recipe

RECIPE = "gsm8k_grpo.py"


FP32 = ("--inference.dtype", "float32", "--train.no-bf16")
SAME_FIRST_BATCH = ("--reward", "tests.rewards_for_tests:completion_length",
                    "--rollout.max-staleness", "0")
"""Rewards that differ within a group, so the first step has a gradient (the tiny model almost
never earns a GSM8K reward, and flat groups have no advantage); synchronous, so the first batch
holds the first prompts whatever finishes first."""


def tiny_args(model: Path, data: Path, run_dir: Path, *extra: str, fp32: bool = True) -> list[str]:
    return ["--model", str(model), "--dataset", str(data), "--run-dir", str(run_dir),
            "--steps", "2", "--eval-size", "4", "--eval-every", "1", "--save-every", "1",
            "--rollout.batch-size", "2", "--rollout.group-size", "2",
            "--sampling.max-new-tokens", "8", *(FP32 if fp32 else ()),
            "--train.optim.lr", "1e-3", *extra]


ROWS = 4  # --rollout.batch-size 2 x --rollout.group-size 2


def check_run_folder(run_dir: Path, steps: int, *, rows_trained: bool = False) -> None:
    """Every step's metrics are there and finite. The policy-loss statistics exist where a row
    was trained: a step whose rows all had zero advantage (the tiny model rarely earns a GSM8K
    reward) skips them all and has none; `rows_trained` says every step must have them."""
    lines = metrics(run_dir)
    trained = [m for m in lines if m["step"] > 0]
    assert [m["step"] for m in trained] == list(range(1, steps + 1))
    for m in trained:
        for key in ("reward/mean", "loss", "grad_norm", "tokens_per_second", "seconds/train",
                    "sync/send_seconds", "eval/accuracy", "response_length/mean",
                    "staleness/mean", "format", "accuracy", "train/skipped_rows",
                    "memory/peak_rss_gb", "reward/flat_group_fraction", "accuracy_lenient",
                    "response_length/clip_fraction", "eval/accuracy_lenient",
                    "eval/accuracy_ci_low", "eval/accuracy_ci_high"):
            assert key in m, key
        assert m["skipped_step"] == 0 and 0 < m["memory/peak_rss_gb"] < 20
        assert m["accuracy"] <= m["accuracy_lenient"]
        assert m["eval/accuracy_ci_low"] <= m["eval/accuracy"] <= m["eval/accuracy_ci_high"]
        if m["train/skipped_rows"] < ROWS or rows_trained:
            for key in ("clip_fraction", "importance_weight_mean", "train/mb_fill"):
                assert key in m, key
            assert math.isfinite(m["importance_weight_mean"])
        else:  # every group flat: nothing to learn from, nothing computed
            assert m["reward/flat_group_fraction"] == 1.0
    assert_finite(run_dir, ("loss", "grad_norm", "reward/mean"))
    assert (run_dir / "config.yaml").read_text().count("batch_size: 2") == 1
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {"prompt", "completion", "reward"} <= set(samples[0])
    assert (run_dir / "checkpoints" / f"step-{steps:06d}" / "hf" / "config.json").exists()


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, gsm8k_file, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one_process") / "run"
    result = run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, run_dir, *SAME_FIRST_BATCH))
    return run_dir, result


def test_one_process(one_process):
    run_dir, result = one_process
    check_run_folder(run_dir, 2, rows_trained=True)
    assert "done:" in result.stdout


def test_two_torchrun_ranks_give_the_one_process_first_step_loss(one_process, tiny_model_dir,
                                                                 gsm8k_file, tmp_path):
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone")
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", *SAME_FIRST_BATCH),
               launcher=torchrun)
    check_run_folder(tmp_path / "run", 2, rows_trained=True)
    one, two = metrics(one_process[0])[1], metrics(tmp_path / "run")[1]
    # rank 0 rolls out the same first batch in both worlds; only the training is split
    assert (one["sample_ids"], one["reward/mean"]) == (two["sample_ids"], two["reward/mean"])
    # with equal-length rows and ratio 1 the surrogate's value is ~0 whatever the split; the
    # global gradient norm is the sharper check that both worlds computed the same update
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert one["grad_norm"] > 1e-2
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)


def test_bf16_training_and_generation_run_end_to_end(tiny_model_dir, gsm8k_file, tmp_path):
    """The recipes' default where bf16 is fast (`config.fast_bf16`), whatever this machine is."""
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", *SAME_FIRST_BATCH,
                                 "--train.bf16", "--inference.dtype", "bfloat16", fp32=False))
    check_run_folder(tmp_path / "run", 2, rows_trained=True)
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "bf16: true" in config and "dtype: bfloat16" in config


def test_launched_protocol_servers(tiny_model_dir, gsm8k_file, tmp_path):
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", "--inference.backend",
                         "sglang", "--inference.server-program", "areal-flow",
                         "--inference.server-gpus", "0", "1"))
    check_run_folder(tmp_path / "run", 2)
    logs = sorted((tmp_path / "run" / "servers").glob("server-*.log"))
    assert len(logs) == 2
    served = [m["pool/requests"] for m in metrics(tmp_path / "run") if "pool/requests" in m]
    assert sum(served) > 0


def sigterm_when(args: list[str], ready, exit_within: float) -> tuple[int, str]:
    """Run the recipe, send SIGTERM once `ready()` (polled: another process writes what it
    reads), and return its exit status and output; it must exit within `exit_within` s."""
    process = subprocess.Popen([sys.executable, str(ROOT / "recipes" / RECIPE), *args], cwd=ROOT,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.1)  # polling for a file another process writes, not ordering our own work
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=exit_within)
    return process.returncode, output


@pytest.mark.faults
def test_resume_after_sigterm_continues_exactly(tiny_model_dir, gsm8k_file, tmp_path):
    """η = 0 and greedy decoding: a run stopped by SIGTERM and resumed consumes the same prompts
    and computes the same losses as a run that never stopped."""
    exact = ["--rollout.max-staleness", "0", "--sampling.temperature", "0", "--eval-size", "0"]
    stopped = tmp_path / "stopped"
    args = tiny_args(tiny_model_dir, gsm8k_file, stopped, *exact, "--steps", "1000")
    returncode, output = sigterm_when(
        args, lambda: list(stopped.glob("checkpoints/step-*/COMPLETE")), exit_within=120)
    assert returncode == 0, output
    assert "stopping after this step" in output
    stop_step = max(m["step"] for m in metrics(stopped))
    assert 1 <= stop_step < 1000
    assert (stopped / "checkpoints" / f"step-{stop_step:06d}" / "COMPLETE").exists()

    total = stop_step + 2
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, stopped, *exact, "--steps", str(total),
                         "--resume"))
    straight = tmp_path / "straight"
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, straight, *exact, "--steps", str(total)))
    resumed, reference = metrics(stopped), metrics(straight)
    assert [m["step"] for m in resumed] == [m["step"] for m in reference]
    for a, b in zip(resumed, reference):
        if a["step"] == 0:
            continue
        assert a["sample_ids"] == b["sample_ids"], a["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), a["step"]
        assert a["reward/mean"] == b["reward/mean"]


def test_the_reasoning_gym_recipe_trains_on_a_task_with_its_verifier(tiny_model_dir, tmp_path):
    """recipes/reasoning_gym_grpo.py: the GRPO loop on reasoning-gym rows, scored by the
    `reasoning_gym` reward, graded strict and lenient, eval on distinct held-out problems."""
    args = tiny_args(tiny_model_dir, Path("unused"), tmp_path / "run", "--sampling.max-new-tokens",
                     "3")
    args[args.index("--dataset") + 1] = "reasoning_gym:chain_sum?max_terms=2&size=50"
    result = run_recipe("reasoning_gym_grpo.py", args)
    check_run_folder(tmp_path / "run", 2)
    assert "50 train rows (seed 0), 4 distinct held-out eval rows (seed 50)" in result.stdout
    prompt = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])["prompt"]
    assert "arithmetic problem" in prompt and "Reply with only the final" in prompt
    lines = metrics(tmp_path / "run")
    # 3 new tokens: most completions are cut off, and the fraction says how many
    assert max(m["response_length/clip_fraction"] for m in lines if m["step"]) > 0
    assert {m["response_length/max"] for m in lines if m["step"]} <= {1.0, 2.0, 3.0}


@pytest.mark.parametrize(("extra", "message"), [
    (["--workflow", "rlvrr"], "rlvr"),
    (["--reward", "gsm9k"], "gsm8k"),
    (["--rollout.group-size", "0"], "group_size"),
    (["--inference.backend", "sglang", "--inference.addresses", "127.0.0.1:9"],
     "no generation server answers"),
    (["--workflow-config", '{"question_field": "query"}'], "query"),
    # rlvr passes answer=...; a reward without that parameter must not silently score 0
    (["--reward", "tests.rewards_for_tests:length"], "cannot take the arguments"),
    (["--dataset", "reasoning_gym:chain_sum?max_term=3"], "unknown config key(s) ['max_term']"),
])
def test_bad_input_is_named(tiny_model_dir, gsm8k_file, tmp_path, extra, message):
    result = run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", *extra),
                        check=False, timeout=120)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


@pytest.mark.faults
@pytest.mark.parametrize(("extra", "message"), [
    (["--model", "{tmp}/no-such-model"], "no-such-model: no such folder"),
    (["--dataset", "{tmp}/missing.jsonl"], "missing.jsonl: no such file"),
    (["--dataset", "{tmp}/empty.jsonl"], "empty.jsonl: the 'train' split has no rows"),
    (["--dataset", "{tmp}/broken.jsonl"], "broken.jsonl, line 2: not JSON"),
    (["--workflow-config", '{"question_field": '], "--workflow-config: not valid JSON"),
    (["--workflow-config", "{tmp}/missing.yaml"], "missing.yaml: no such file"),
    (["--sampling.max-new-tokens", "100000"], "leaves no room for a prompt"),
    (["--train.ppo-minibatches", "3"], "--train.ppo-minibatches 3 is more than the 2 groups"),
    (["--rollout.group-size", "1"], "--rollout.group-size 1: GRPO"),
])
def test_bad_input_is_refused_before_any_weights_load(tiny_model_dir, gsm8k_file, tmp_path,
                                                      extra, message):
    """Named, and before any weights load (so before the run folder gets a config or metrics:
    the same command, corrected, starts a fresh run)."""
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "broken.jsonl").write_text('{"question": "1 + 1?", "answer": "2"}\n{"question"\n')
    extra = [arg.replace("{tmp}", str(tmp_path)) for arg in extra]
    result = run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", *extra),
                        check=False, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert message in output
    assert "Loading weights" not in output  # transformers' progress line when a model loads
    assert not list((tmp_path / "run").glob("*.*"))  # no config.yaml, metrics.jsonl, ...


@pytest.mark.faults
def test_a_run_whose_every_reward_fails_does_not_succeed(tiny_model_dir, gsm8k_file, tmp_path):
    """Defaults are not rewards: the run stops with the reward's error, not exit 0."""
    result = run_recipe(RECIPE, tiny_args(
        tiny_model_dir, gsm8k_file, tmp_path / "run", "--steps", "6",
        "--reward", "tests.rewards_for_tests:always_fails"), check=False, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-2000:]
    assert "failed on 32 of its last 32 calls" in output
    assert "this reward is broken" in output


HANGS = ["--workflow", "tests.workflows_for_tests:hangs_after_8_episodes", "--eval-size", "0",
         "--steps", "10", "--save-every", "100"]


@pytest.mark.faults
def test_sigterm_while_waiting_for_a_batch_checkpoints_and_stops(tiny_model_dir, gsm8k_file,
                                                                  tmp_path):
    """Step 3's batch never comes: SIGTERM ends the wait itself (not a step that never ends),
    writes a checkpoint of step 2 (none was due) and exits cleanly, resumable."""
    run_dir = tmp_path / "run"
    returncode, output = sigterm_when(
        tiny_args(tiny_model_dir, gsm8k_file, run_dir, *HANGS),
        lambda: (run_dir / "metrics.jsonl").exists() and
        max(m["step"] for m in metrics(run_dir)) >= 2, exit_within=60)
    assert returncode == 0, output
    assert "stopped before step 3" in output
    assert (run_dir / "checkpoints" / "step-000002" / "COMPLETE").exists()


@pytest.mark.faults
def test_no_batch_within_the_timeout_fails_after_a_checkpoint(tiny_model_dir, gsm8k_file,
                                                              tmp_path):
    run_dir = tmp_path / "run"
    # 10 s: the first batch also waits for the reward workers to start (seconds under load)
    result = run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, run_dir, *HANGS,
                                          "--rollout.batch-timeout", "10"),
                        check=False, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-2000:]
    assert "no batch in 10 s (--rollout.batch-timeout)" in output
    assert max(m["step"] for m in metrics(run_dir)) == 2
    assert (run_dir / "checkpoints" / "step-000002" / "COMPLETE").exists()
