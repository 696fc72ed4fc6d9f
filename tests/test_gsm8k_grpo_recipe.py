"""recipes/gsm8k_grpo.py end to end on the tiny model: one process, two torchrun ranks, launched
SGLang-protocol servers; exact resume after kill -9 or SIGTERM; clear errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, assert_finite, metrics, needs, run_recipe, run_recipe_cases

RECIPE = "gsm8k_grpo.py"


FP32 = ("--inference.dtype", "float32", "--train.dtype", "float32")
SAME_FIRST_BATCH = ("--reward", "tests.rewards_for_tests:completion_length",
                    "--rollout.max-staleness", "0")
"""Rewards that differ within a group, so the first step has a gradient (the tiny model almost
never earns a GSM8K reward, and flat groups have no advantage); synchronous, so the first batch
holds the first prompts whatever finishes first."""


def tiny_args(model: Path, data: Path, run_dir: Path, *extra: str, fp32: bool = True,
              compile: str = "off") -> list[str]:
    """`compile` off by default: compiling costs each training process a few seconds (about
    90 s of the suite); `test_one_process` runs the recipes' default, test_engine_steps.py
    checks the compiled parts' numbers."""
    return ["--model", str(model), "--dataset", str(data), "--run-dir", str(run_dir),
            "--steps", "2", "--eval-size", "4", "--eval-every", "1", "--save-every", "1",
            "--rollout.batch-size", "2", "--rollout.group-size", "2",
            "--sampling.max-new-tokens", "8", *(FP32 if fp32 else ()),
            "--train.optim.lr", "1e-3", "--train.compile", compile, *extra]


ROWS = 4  # --rollout.batch-size 2 x --rollout.group-size 2


GSM8K_METRICS = ("accuracy", "accuracy_lenient", "format", "work_shown")
"""The gsm8k reward's `metrics`: the panel's numbers when the run's reward is gsm8k."""


def check_run_folder(run_dir: Path, steps: int, *, rows_trained: bool = False,
                     task: tuple[str, ...] = GSM8K_METRICS) -> None:
    """Every step's metrics are there and finite. The policy-loss statistics exist where a row
    was trained: a step whose rows all had zero advantage (the tiny model rarely earns a GSM8K
    reward) skips them all and has none; `rows_trained` says every step must have them. The
    reward's own metrics (`task`, GSM8K's by default), and no others, are there, each with its
    eval/ counterpart."""
    lines = metrics(run_dir)
    trained = [m for m in lines if m["step"] > 0]
    assert [m["step"] for m in trained] == list(range(1, steps + 1))
    for m in trained:
        for key in ("reward/mean", "loss", "grad_norm", "tokens_per_second", "seconds/train",
                    "sync/send_seconds", "perf/mfu", "eval/reward", "eval/response_length",
                    "response_length/mean", "staleness/mean", "train/skipped_rows",
                    "memory/peak_rss_gb", "reward/flat_group_fraction",
                    "response_length/clip_fraction"):
            assert key in m, key
        # trained FLOPs over the measured GEMM rate: never above the rate, and 0 for a step
        # that trained no token (its rows all skipped) whatever the batch held
        assert 0 <= m["perf/mfu"] < 1
        assert (m["perf/mfu"] > 0) == (m["train/skipped_rows"] < ROWS), m["perf/mfu"]
        expected = [*task, *(f"eval/{name}" for name in task),
                    *(f"eval/{name}_ci_{end}" for name in task for end in ("low", "high"))]
        assert sorted(k for k in m if k.split("/")[-1].split("_ci_")[0] in
                      {*GSM8K_METRICS, *task}) == sorted(expected)
        assert m["task_metrics"] == sorted(task)
        if task:
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
    result = run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, run_dir, *SAME_FIRST_BATCH,
                                          compile="auto"))
    return run_dir, result


def test_one_process(one_process):
    run_dir, result = one_process
    check_run_folder(run_dir, 2, rows_trained=True, task=())
    assert "done:" in result.stdout
    # each eval's greedy episodes (--eval-size 4, before step 1 and after each step), whose
    # rewards are the ones eval/reward averages
    evals = [json.loads(line)
             for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m["eval/reward"] for m in metrics(run_dir) if "eval/reward" in m}
    assert sorted(by_step) == [0, 1, 2]
    for step, mean in by_step.items():
        rows = [e for e in evals if e["step"] == step]
        assert [e["index"] for e in rows] == [0, 1, 2, 3]
        assert sum(e["reward"] for e in rows) / 4 == pytest.approx(mean)
        assert all(turn["model"] and turn["text"] for e in rows for turn in e["transcript"])


def test_two_torchrun_ranks_give_the_one_process_first_step_loss(one_process, tiny_model_dir,
                                                                 gsm8k_file, tmp_path):
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone")
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", *SAME_FIRST_BATCH),
               launcher=torchrun)
    check_run_folder(tmp_path / "run", 2, rows_trained=True, task=())
    one, two = metrics(one_process[0])[1], metrics(tmp_path / "run")[1]
    # rank 0 rolls out the same first batch in both worlds; only the training is split
    assert (one["sample_ids"], one["reward/mean"]) == (two["sample_ids"], two["reward/mean"])
    # with equal-length rows and ratio 1 the surrogate's value is ~0 whatever the split; the
    # global gradient norm is the sharper check that both worlds computed the same update
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert one["grad_norm"] > 1e-2
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)


def test_bf16_generation_for_fp32_training_runs_with_the_mismatch_corrected(
        tiny_model_dir, gsm8k_file, tmp_path):
    """The recipes' choice where bf16 decodes fast but training stays fp32 (`runtime/
    precision.py`; bf16 training: test_engine_steps), whatever this machine is: the mismatch
    correction "auto" settles on TIS, which weighs the current version's tokens by
    min(pi_train / pi_rollout, 2) (without it their weight is 1 in the recipe)."""
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", *SAME_FIRST_BATCH,
                                 "--train.dtype", "float32", "--inference.dtype", "bfloat16",
                                 "--rollout.max-staleness", "0", fp32=False))
    check_run_folder(tmp_path / "run", 2, rows_trained=True, task=())
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "dtype: bfloat16" in config and "mismatch_correction: tis" in config
    weights = [m["importance_weight_max"] for m in metrics(tmp_path / "run")
               if "importance_weight_max" in m]
    assert weights and max(abs(w - 1) for w in weights) > 1e-4, weights


@pytest.mark.faults
def test_a_failed_weight_update_keeps_the_step_it_follows_and_the_run_resumes(
        tiny_model_dir, gsm8k_file, tmp_path):
    """Any failure after a step trained (here the weight update: its folder cannot be made)
    writes that step's checkpoint first; the resumed run goes on from it without losing a
    step."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "weights").write_text("a file where the weight folder goes")
    servers = ("--inference.backend", "sglang", "--inference.server-program", "areal-flow",
               "--inference.server-gpus", "0")
    result = run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, run_dir, *servers,
                                          "--save-every", "100"), check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "weights" in output, output[-3000:]
    assert [m["step"] for m in metrics(run_dir)] == [0, 1]  # the trained step is logged
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000001"]
    (run_dir / "weights").unlink()
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, run_dir, *servers, "--resume"))
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2]  # step 1 kept, not redone


def test_launched_protocol_servers(tiny_model_dir, gsm8k_file, tmp_path):
    run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", "--inference.backend",
                         "sglang", "--inference.server-program", "areal-flow",
                         "--inference.server-gpus", "0", "1"))
    check_run_folder(tmp_path / "run", 2)
    logs = sorted((tmp_path / "run" / "servers").glob("server-*.log"))
    assert len(logs) == 2
    served = [m["pool/requests"] for m in metrics(tmp_path / "run") if "pool/requests" in m]
    assert sum(served) > 0


def signal_when(args: list[str], ready, exit_within: float,
                sig: signal.Signals = signal.SIGTERM) -> tuple[int, str]:
    """Run the recipe, send `sig` once `ready()` (polled: another process writes what it
    reads), and return its exit status and output; it must exit within `exit_within` s."""
    process = subprocess.Popen([sys.executable, str(ROOT / "recipes" / RECIPE), *args], cwd=ROOT,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready():
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
            time.sleep(0.1)  # polling for a file another process writes, not ordering our work
        process.send_signal(sig)
        output, _ = process.communicate(timeout=exit_within)
        return process.returncode, output
    finally:  # a failed check must not leave a run behind
        if process.poll() is None:
            process.kill()
            process.wait()


def last_logged_step(run_dir: Path) -> int:
    """The last step in metrics.jsonl while the run writes it (an empty file or a line cut
    short are read as not there yet)."""
    file = run_dir / "metrics.jsonl"
    steps = [0]
    for line in file.read_text().splitlines() if file.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            break
    return max(steps)


def final_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """A checkpoint's weights and optimizer state, flattened to name -> tensor."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = run_dir / "checkpoints" / f"step-{step:06d}"
    dcp_to_torch_save(folder / "dcp", run_dir / "state.pt")
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(run_dir / "state.pt", weights_only=False))
    return flat


@pytest.mark.faults
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_stopped_run_resumes_exactly_with_sampling(sig, tiny_model_dir, gsm8k_file, tmp_path):
    """Sampled decoding, groups of 4 whose rewards differ (every step moves the weights), η = 0:
    a run killed (or stopped by SIGTERM) and resumed from its last checkpoint trains the same
    prompts on the same completions, with the same losses, and ends with the same weights and
    optimizer state as a run that never stopped. An entropy target above the tiny model's
    entropy raises GRPO's adaptive coefficient every step: the resume continues it."""
    def args(run_dir: Path, steps: int, *extra: str) -> list[str]:
        return tiny_args(tiny_model_dir, gsm8k_file, run_dir, *SAME_FIRST_BATCH,
                         "--rollout.group-size", "4", "--samples-per-step", "8",
                         "--algorithm.entropy-target", "100", "--algorithm.entropy-coef-step",
                         "0.01", "--eval-size", "0", "--steps", str(steps), *extra)

    stopped = tmp_path / "stopped"
    returncode, output = signal_when(
        args(stopped, 1000), lambda: (stopped / "checkpoints" / "step-000002" / "COMPLETE").exists(),
        exit_within=120, sig=sig)
    assert returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL), output
    last = max(int(p.parent.name[5:]) for p in stopped.glob("checkpoints/step-*/COMPLETE"))
    assert 2 <= last < 1000

    total = last + 2
    run_recipe(RECIPE, args(stopped, total, "--resume"))
    straight = tmp_path / "straight"
    run_recipe(RECIPE, args(straight, total))
    resumed, reference = metrics(stopped), metrics(straight)
    assert [m["step"] for m in resumed] == list(range(total + 1))
    for a, b in zip(resumed[1:], reference[1:]):
        assert a["sample_ids"] == b["sample_ids"], a["step"]
        assert a["reward/mean"] == b["reward/mean"], a["step"]
        # the surrogate's value is ~0 at ratio 1 (rounding noise); the gradient is the check
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), a["step"]
        assert a["grad_norm"] > 1e-3  # the weights moved
        assert a["entropy_coef"] == pytest.approx(0.01 * a["step"]), a["step"]
    samples = [[(s["step"], s["completion"]) for s in map(json.loads, (run / "samples.jsonl")
                                                          .read_text().splitlines())]
               for run in (stopped, straight)]
    assert samples[0] == samples[1] and len(samples[0]) == 8 * total
    assert len({c for _, c in samples[0]}) > total  # sampled: completions differ
    # Equal up to the engine's batching: the behaviour logprobs of a completion vary in the
    # last bits with the requests it was batched with (two uninterrupted runs differ as much),
    # and Adam magnifies that where its second moment is tiny, so compare whole tensors: the
    # gap between the runs against how far training moved the weights. A wrong resume (fresh
    # optimizer, a step lost or repeated) makes them as far apart as the training moved them.
    ours, theirs = final_state(stopped, total), final_state(straight, total)
    assert sorted(ours) == sorted(theirs) and any(k.startswith("/optim") for k in ours)
    initial = load_file(tiny_model_dir / "model.safetensors")
    gap = sum(float((ours[f"/model/{k}"] - theirs[f"/model/{k}"]).norm() ** 2) for k in initial)
    moved = sum(float((theirs[f"/model/{k}"] - w).norm() ** 2) for k, w in initial.items())
    assert gap ** 0.5 <= 1e-3 * moved ** 0.5, (gap ** 0.5, moved ** 0.5)
    for name in (k for k in ours if k.startswith("/optim")):
        assert float((ours[name] - theirs[name]).norm()) <= 1e-3 * float(theirs[name].norm()), name


@needs("reasoning_gym", "reasoning-gym")
def test_the_reasoning_gym_recipe_trains_on_a_task_with_its_verifier(tiny_model_dir, tmp_path):
    """recipes/reasoning_gym_grpo.py: the GRPO loop on reasoning-gym rows, scored by the
    `reasoning_gym` reward, graded strict and lenient, eval on distinct held-out problems."""
    args = tiny_args(tiny_model_dir, Path("unused"), tmp_path / "run", "--sampling.max-new-tokens",
                     "3")
    args[args.index("--dataset") + 1] = "reasoning_gym:chain_sum?max_terms=2&size=50"
    result = run_recipe("reasoning_gym_grpo.py", args)
    check_run_folder(tmp_path / "run", 2, task=("accuracy", "accuracy_lenient", "format"))
    assert "50 train rows (seed 0), 4 distinct held-out eval rows (seed 50)" in result.stdout
    prompt = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])["prompt"]
    assert "arithmetic problem" in prompt and "Reply with only the final" in prompt
    lines = metrics(tmp_path / "run")
    # 3 new tokens: most completions are cut off, and the fraction says how many
    assert max(m["response_length/clip_fraction"] for m in lines if m["step"]) > 0
    assert {m["response_length/max"] for m in lines if m["step"]} <= {1.0, 2.0, 3.0}


BAD_INPUT_NAMED = [
    (["--workflow", "rlvrr"], "rlvr"),
    (["--reward", "gsm9k"], "gsm8k"),
    (["--rollout.group-size", "0"], "group_size"),
    (["--inference.backend", "sglang", "--inference.addresses", "127.0.0.1:9",
      "--inference.startup-timeout", "2"],
     "no generation server answers"),
    # rlvr passes answer=...; a reward without that parameter must not silently score 0
    (["--reward", "tests.rewards_for_tests:length"], "cannot take the arguments"),
    (["--workflow", "tests.workflows_for_tests:no_reward_option", "--reward", "gsm8k"],
     "has none (its fields: prefix): drop --reward, or declare `reward: str`"),
    (["--dataset", "reasoning_gym:chain_sum?max_term=3"], "unknown config key(s) ['max_term']"),
]
BAD_INPUT_BEFORE_WEIGHTS = [
    (["--model", "{tmp}/no-such-model"], "no-such-model: no such folder"),
    (["--dataset", "{tmp}/missing.jsonl"], "missing.jsonl: no such file"),
    (["--dataset", "{tmp}/empty.jsonl"], "empty.jsonl: the 'train' split has no rows"),
    (["--dataset", "{tmp}/broken.jsonl"], "broken.jsonl, line 2: not JSON"),
    (["--dataset", "{tmp}/two.jsonl"], "--eval-size 4 takes all 2 rows, leaving none to train"),
    (["--workflow-config", '{"question_field": '], "--workflow-config: not valid JSON"),
    (["--workflow-config", "{tmp}/missing.yaml"], "missing.yaml: no such file"),
    (["--workflow-config", '{"question_field": "query"}'],
     "row 0 has no field 'query' (it has: question, answer), which the workflow's "
     "question_field names"),
    (["--dataset", "{tmp}/no_answer.jsonl"], "has no field 'answer' (it has: question)"),
    (["--sampling.max-new-tokens", "100000"], "leaves no room for a prompt"),
    (["--train.ppo-minibatches", "3"], "--train.ppo-minibatches 3 is more than the 2 groups"),
    (["--critic.ppo-minibatches", "2"], "--critic.ppo-minibatches 2: the critic"),
    (["--rollout.group-size", "1"], "--rollout.group-size 1: grpo scores a row against the rest"),
    (["--algorithm", "grpp"], "--algorithm grpp: unknown algorithm 'grpp'"),
    (["--algorithm", "ppo", "--algorithm.kl-coeff", "0.1"], "--algorithm.kl-coef"),
]


@pytest.fixture(scope="module")
def bad_input(tiny_model_dir, gsm8k_file, tmp_path_factory):
    """Every bad command line above, run by the recipe in one process (tests/recipe_cases.py):
    case -> (its run folder, exit code, what it printed)."""
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "broken.jsonl").write_text('{"question": "1 + 1?", "answer": "2"}\n{"question"\n')
    (tmp / "no_answer.jsonl").write_text('{"question": "1 + 1?", "answer": "2"}\n' * 2
                                         + '{"question": "2 + 1?"}\n' * 6)
    (tmp / "two.jsonl").write_text('{"question": "1 + 1?", "answer": "2"}\n'
                                   '{"question": "2 + 1?", "answer": "3"}\n')
    cases = {}
    for i, (extra, _) in enumerate(BAD_INPUT_NAMED + BAD_INPUT_BEFORE_WEIGHTS):
        extra = [arg.replace("{tmp}", str(tmp)) for arg in extra]
        cases[json.dumps(extra)] = tiny_args(tiny_model_dir, gsm8k_file, tmp / f"run{i}", *extra)
    results = run_recipe_cases(cases, tmp)

    def outcome(extra: list[str]) -> tuple[Path, int, str]:
        case = json.dumps([arg.replace("{tmp}", str(tmp)) for arg in extra])
        return (Path(cases[case][cases[case].index("--run-dir") + 1]), *results[case])

    return outcome


@pytest.mark.parametrize(("extra", "message"), BAD_INPUT_NAMED)
def test_bad_input_is_named(bad_input, extra, message):
    if "reasoning_gym:" in " ".join(extra) and importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("needs reasoning_gym: pip install 'areal-flow[reasoning-gym]'")
    _, code, output = bad_input(extra)
    assert code != 0
    assert message in output


@pytest.mark.faults
@pytest.mark.parametrize(("extra", "message"), BAD_INPUT_BEFORE_WEIGHTS)
def test_bad_input_is_refused_before_any_weights_load(bad_input, extra, message):
    """Named, and before any weights load (so before the run folder gets a config or metrics:
    the same command, corrected, starts a fresh run); as a bad option is: exit 2, one line,
    no traceback."""
    run_dir, code, output = bad_input(extra)
    assert code == 2 and "Traceback" not in output, output
    assert message in output
    assert "Loading weights" not in output  # transformers' progress line when a model loads
    # no config.yaml, metrics.jsonl, ... (run.lock, the live run's lock, stays: see run_lock.py)
    assert not [p for p in run_dir.glob("*.*") if p.name != "run.lock"]


@pytest.mark.faults
def test_a_resume_on_a_folder_a_live_run_holds_is_refused_at_start(tiny_model_dir, gsm8k_file,
                                                                   tmp_path):
    """Two runs in one folder would overwrite each other's checkpoints: the second is refused
    before any weights load, naming the live holder (areal_flow/run_lock.py)."""
    from tests.helpers import hold_folder

    holder = hold_folder(tmp_path / "run")
    try:
        result = run_recipe(RECIPE, tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run",
                                              "--resume"), check=False, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"is in use by a live run: pid {holder.pid} on" in output
    assert "Loading weights" not in output


@pytest.mark.faults
def test_a_run_whose_every_reward_fails_ends_where_the_limit_is_passed(tiny_model_dir,
                                                                       gsm8k_file, tmp_path):
    """Defaults are not rewards: once the failure rate passes the limit the run stops with the
    reward's error, never retried as a workflow error and never reaching its last step (a run
    of a few steps used to end 'done', exit 0), after a checkpoint of the last step it
    trained."""
    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, tiny_args(
        tiny_model_dir, gsm8k_file, run_dir, "--steps", "30", "--save-every", "100",
        "--reward", "tests.rewards_for_tests:always_fails"), check=False, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-2000:]
    assert re.search(r"failed on (\d+) of its last \1 calls", output)  # 32 or more at once
    assert "this reward is broken" in output
    assert "RewardFailureError" not in "".join(
        line for line in output.splitlines() if "failed on sample" in line)  # not retried
    lines = [m for m in metrics(run_dir) if m["step"] > 0]
    trained = [m["step"] for m in lines]
    # 32 calls of 4 rows a step: detected within the tenth step (in flight: up to 2 more)
    assert trained and max(trained) <= 12, trained
    # every group flat, every row skipped: no token trained, so no MFU (the batch's tokens over
    # a few milliseconds read 630 % in a soak)
    assert {m["train/skipped_rows"] for m in lines} == {ROWS}
    assert {m["perf/mfu"] for m in lines} == {0.0}
    assert trained == list(range(1, len(trained) + 1))  # every trained step logged
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step-{max(trained):06d}"]


HANGS = ["--workflow", "tests.workflows_for_tests:hangs_after_8_episodes", "--eval-size", "0",
         "--steps", "10", "--save-every", "100"]


@pytest.mark.faults
def test_sigterm_while_waiting_for_a_batch_checkpoints_and_stops(tiny_model_dir, gsm8k_file,
                                                                  tmp_path):
    """Step 3's batch never comes: SIGTERM ends the wait itself (not a step that never ends),
    writes a checkpoint of step 2 (none was due) and exits cleanly, resumable."""
    run_dir = tmp_path / "run"
    returncode, output = signal_when(
        tiny_args(tiny_model_dir, gsm8k_file, run_dir, *HANGS),
        lambda: last_logged_step(run_dir) >= 2, exit_within=60)
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


@pytest.mark.faults
def test_a_dataset_source_without_its_extra_is_one_line_naming_the_extra(tiny_model_dir,
                                                                        monkeypatch, capsys):
    import sys

    from areal_flow import rl_recipes

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now fails
    monkeypatch.setattr(rl_recipes, "same_on_all_ranks", lambda value: value)  # one rank
    cfg = rl_recipes.RLConfig(dataset="reasoning_gym:chain_sum?size=20", eval_size=4)
    with pytest.raises(SystemExit) as exit_:
        rl_recipes.load_data(cfg, str(tiny_model_dir), rank=0)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --dataset reasoning_gym:... needs the reasoning-gym package: pip install "
        "'areal-flow[reasoning-gym]'")


def test_the_in_process_engine_decodes_nothing_while_the_trainer_trains(
        tiny_model_dir, gsm8k_file, tmp_path, monkeypatch):
    """At max_staleness 1 the next batch's requests are in flight while a batch trains: the
    engine makes no decode step until the trainer waits again (it shares the trainer's cores).
    (--inference.decode-while-training, which lets it go on, is benchmarks/async_sync.py's
    comparison row.)"""
    import threading

    from areal_flow import rl_recipes
    from areal_flow.inference.local import LocalEngine
    from areal_flow.runtime.engine import TrainEngine

    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    import gsm8k_grpo

    training, during, engines, probed = threading.Event(), [], [], []
    decode, forwards = LocalEngine._decode, TrainEngine.role_forwards

    def counted_decode(self):
        engines.append(self)
        during.append(training.is_set())
        return decode(self)

    def slow_forwards(self, *args, **kwargs):
        engine = engines[-1]
        # the probe: the first training station that starts with requests in the engine (its
        # queues: nothing public says so); the next batch's have just started then
        if probed or not (engine._running or engine._waiting):
            return forwards(self, *args, **kwargs)
        probed.append(True)
        training.set()
        try:
            time.sleep(1.0)  # time for an engine thread to decode them, were it running
            return forwards(self, *args, **kwargs)
        finally:
            training.clear()

    monkeypatch.setattr(LocalEngine, "_decode", counted_decode)
    monkeypatch.setattr(TrainEngine, "role_forwards", slow_forwards)
    # the engine decodes 4 rows at a time: the next batch's rows start once this batch's are
    # done and run 64 tokens, past EOS (the later --sampling.max-new-tokens counts), so they
    # are in flight when this batch's training starts
    # a bf16 engine, with weights of its own: with the fp32 trainer's tensors shared, the
    # engine thread running (the pause removed) decoded nothing within the probe once in 3
    args = tiny_args(tiny_model_dir, gsm8k_file, tmp_path / "run", "--rollout.max-staleness",
                     "1", "--eval-size", "0", *SAME_FIRST_BATCH[:2], "--steps", "3",
                     "--inference.max-batch-size", "4", "--sampling.max-new-tokens", "64",
                     "--sampling.ignore-eos", "--inference.dtype", "bfloat16", "--train.dtype",
                     "float32", fp32=False)
    gsm8k_grpo.main(rl_recipes.cli(gsm8k_grpo.Config, args))
    assert probed, "no training started with requests in the engine: nothing was probed"
    assert during.count(False) > 0  # it decoded while the trainer waited
    assert during.count(True) == 0, during
