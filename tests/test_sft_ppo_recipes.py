"""recipes/gsm8k_sft.py and recipes/gsm8k_ppo.py end to end on the tiny model: SFT lowers the
held-out NLL, PPO's critic loss falls, both resume exactly, trackers and checkpoint pruning."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.helpers import assert_finite, metrics, needs, run_recipe


def sft_args(model: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--dataset", str(data), "--run-dir", str(run_dir),
            "--steps", "16", "--eval-size", "4", "--eval-every", "4", "--save-every", "4",
            "--batch-size", "4", "--train.dtype", "float32", "--train.optim.lr", "1e-2", *extra]


def ppo_args(model: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    # the length of the completion is a reward the tiny model's critic can learn to predict
    return ["--model", str(model), "--dataset", str(data), "--run-dir", str(run_dir),
            "--steps", "12", "--eval-size", "0", "--save-every", "6",
            "--reward", "tests.rewards_for_tests:completion_length",
            "--rollout.batch-size", "8", "--sampling.max-new-tokens", "8",
            "--inference.dtype", "float32", "--train.dtype", "float32", "--train.optim.lr", "1e-3",
            "--critic.dtype", "float32", "--critic.optim.lr", "1e-2",
            # a few seconds of compiling a process (tiny_args says why)
            "--train.compile", "off", "--critic.compile", "off", *extra]


@needs("tensorboard", "trackers")  # the run logs to it
def test_sft_lowers_heldout_nll_logs_to_tensorboard_and_keeps_the_newest_checkpoint(
        tiny_model_dir, gsm8k_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    result = run_recipe("gsm8k_sft.py", sft_args(tiny_model_dir, gsm8k_file, run_dir,
                                                 "--logger", "tensorboard"))
    assert "done:" in result.stdout
    evals = {m["step"]: m["eval/nll"] for m in metrics(run_dir) if "eval/nll" in m}
    assert sorted(evals) == [0, 4, 8, 12, 16]
    assert evals[16] < 0.7 * evals[0], evals
    trained = [m for m in metrics(run_dir) if m["step"] > 0]
    assert all({"nll", "loss", "grad_norm", "tokens_per_second"} <= set(m) for m in trained)
    assert_finite(run_dir, ("nll", "loss", "grad_norm"))

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert {e.step: e.value for e in events.Scalars("eval/nll")} == pytest.approx(evals)
    # --keep-checkpoints 2 (the default): older checkpoints go once a newer one is complete
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-000012", "step-000016"]
    assert (run_dir / "checkpoints" / "step-000016" / "hf" / "config.json").exists()


def test_sft_resumes_exactly(tiny_model_dir, gsm8k_file, tmp_path):
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    run_recipe("gsm8k_sft.py", sft_args(tiny_model_dir, gsm8k_file, stopped, "--steps", "6"))
    run_recipe("gsm8k_sft.py", sft_args(tiny_model_dir, gsm8k_file, stopped, "--steps", "10",
                                        "--resume"))
    run_recipe("gsm8k_sft.py", sft_args(tiny_model_dir, gsm8k_file, straight, "--steps", "10"))
    resumed, reference = metrics(stopped), metrics(straight)
    assert [m["step"] for m in resumed] == [m["step"] for m in reference]
    for a, b in zip(resumed, reference):
        for key in ("nll", "eval/nll"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)


def test_sft_names_a_missing_dataset_field(tiny_model_dir, gsm8k_file, tmp_path):
    result = run_recipe("gsm8k_sft.py", sft_args(tiny_model_dir, gsm8k_file, tmp_path / "run",
                                                 "--question-field", "query"), check=False)
    assert result.returncode != 0
    assert "no field 'query'" in result.stderr


def test_ppo_critic_loss_falls(tiny_model_dir, gsm8k_file, tmp_path):
    run_dir = tmp_path / "run"
    run_recipe("gsm8k_ppo.py", ppo_args(tiny_model_dir, gsm8k_file, run_dir))
    trained = [m for m in metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == list(range(1, 13))
    losses = [m["critic/value_loss"] for m in trained]
    assert statistics.mean(losses[-4:]) < 0.5 * statistics.mean(losses[:4]), losses
    assert all("reward/mean" in m and "clip_fraction" in m for m in trained)
    assert_finite(run_dir, ("loss", "grad_norm", "reward/mean", "critic/value_loss",
                            "critic/grad_norm"))
    assert (run_dir / "checkpoints" / "step-000012" / "critic" / "trainer_state.pt").exists()


def test_ppo_resumes_exactly_with_its_critic(tiny_model_dir, gsm8k_file, tmp_path):
    """η = 0 and greedy decoding: the critic's values after a resume are those of a run that
    never stopped, so the value losses match (they would not with a fresh critic)."""
    exact = ["--rollout.max-staleness", "0", "--sampling.temperature", "0"]
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    run_recipe("gsm8k_ppo.py", ppo_args(tiny_model_dir, gsm8k_file, stopped, *exact,
                                        "--steps", "3"))
    run_recipe("gsm8k_ppo.py", ppo_args(tiny_model_dir, gsm8k_file, stopped, *exact,
                                        "--steps", "5", "--resume"))
    run_recipe("gsm8k_ppo.py", ppo_args(tiny_model_dir, gsm8k_file, straight, *exact,
                                        "--steps", "5"))
    resumed, reference = metrics(stopped), metrics(straight)
    assert [m["step"] for m in resumed] == [m["step"] for m in reference]
    for a, b in zip(resumed[1:], reference[1:]):
        assert a["sample_ids"] == b["sample_ids"], a["step"]
        # not the actor loss: whitened advantages make it ~0, all rounding noise, and the rows
        # of a batch arrive in completion order
        for key in ("critic/value_loss", "critic/return_mean", "entropy", "reward/mean"):
            # a step whose rows all have zero advantage computes no policy loss (no entropy)
            assert (key in a) == (key in b), (a["step"], key)
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)
        assert a["train/skipped_rows"] == b["train/skipped_rows"]
    assert any("entropy" in m for m in reference[1:])
