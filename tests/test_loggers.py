"""The trackers behind `--logger`: real TensorBoard event files, a real (offline) W&B run."""

from __future__ import annotations

import sys

import pytest

from areal_flow import registry
from areal_flow.registry import UnknownNameError
from areal_flow.run import RunConfig, RunDir, mark_complete
from tests.helpers import needs


def scalars(run_dir, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


def test_both_trackers_are_registered_loggers():
    assert {"tensorboard", "wandb"} <= set(registry.loggers.names())
    kinds = {(p.kind, p.name) for p in registry.loggers.plugins()}
    assert ("logger", "tensorboard") in kinds


def test_an_unknown_logger_name_fails_with_a_suggestion():
    with pytest.raises(UnknownNameError, match="Did you mean 'tensorboard'"):
        RunConfig(logger=("tensorbord",))


def mark_checkpoint(run: RunDir, step: int) -> None:
    """An (empty) complete checkpoint at `step`, for RunDir(resume=True) to accept."""
    run.checkpoint_dir(step).mkdir(parents=True)
    mark_complete(run.checkpoint_dir(step))


@needs("tensorboard", "trackers")
def test_tensorboard_gets_every_number_and_a_resume_replaces_the_redone_steps(tmp_path):
    run = RunDir(tmp_path)
    run.start_loggers(["tensorboard"], RunConfig(), step=0)
    for step in (1, 2, 3, 4):
        run.log_metrics(step, {"loss": float(step), "sample_ids": [1, 2], "done": True})
    run.close()
    assert scalars(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]

    mark_checkpoint(run, 2)
    resumed = RunDir(tmp_path, resume=True)  # from the checkpoint at step 2: 3 and 4 are redone
    resumed.start_loggers(["tensorboard"], RunConfig(), step=2)
    for step in (3, 4):
        resumed.log_metrics(step, {"loss": 10.0 * step})
    resumed.close()
    assert scalars(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


@needs("wandb", "trackers")
def test_wandb_offline_run_gets_the_metrics_and_a_resume_continues_the_same_run(
        tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunDir(tmp_path)
    run.start_loggers(["wandb"], RunConfig(seed=7), step=0)
    wandb_run = run.loggers[0].run
    run.log_metrics(1, {"reward/mean": 0.25, "sample_ids": [3]})
    run.log_metrics(2, {"reward/mean": 0.5})
    assert wandb_run.summary["reward/mean"] == 0.5
    assert wandb_run.config["seed"] == 7
    assert wandb_run.name == tmp_path.name
    first_id = wandb_run.id
    run.close()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{first_id}/run-{first_id}.wandb"))

    mark_checkpoint(run, 2)
    resumed = RunDir(tmp_path, resume=True)
    resumed.start_loggers(["wandb"], RunConfig(seed=7), step=2)
    assert resumed.loggers[0].run.id == first_id
    resumed.close()


def test_a_tracker_that_is_not_installed_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r"pip install wandb"):
        RunDir(tmp_path).start_loggers(["wandb"], RunConfig(), step=0)
