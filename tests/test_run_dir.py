"""The run folder keeps what a run has done: checkpoints are trusted only when whole, a damaged
newest one falls back to the one before, --resume with nothing to resume from refuses instead of
starting over, and a metrics file cut off mid-line does not stop a resume."""

from __future__ import annotations

import json
import os
import signal

import pytest

from areal_flow.run import COMPLETE, RunConfig, RunDir, StopRequest, mark_complete

pytestmark = pytest.mark.faults


def fake_checkpoint(run: RunDir, step: int, *, complete: bool = True):
    """A checkpoint folder with the files a real one has (contents do not matter here)."""
    path = run.checkpoint_dir(step)
    (path / "hf").mkdir(parents=True)
    (path / "hf" / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (path / "trainer_state.pt").write_bytes(b"state" * 10)
    if complete:
        mark_complete(path)
    return path


def write_metrics(run: RunDir, steps: range, tail: str = "") -> None:
    lines = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)
    (run.path / "metrics.jsonl").write_text(lines + tail)


def test_a_truncated_newest_checkpoint_falls_back_to_the_last_good_one(tmp_path):
    run = RunDir(tmp_path)
    fake_checkpoint(run, 4)
    newest = fake_checkpoint(run, 8)
    assert run.latest_checkpoint() == (8, newest)
    model = newest / "hf" / "model.safetensors"
    whole = model.read_bytes()
    model.write_bytes(whole[:1000])  # a disk filled up, a copy cut short
    with pytest.warns(UserWarning, match=r"step-000008.*model.safetensors has 1000 bytes"):
        assert run.latest_checkpoint() == (4, run.checkpoint_dir(4))
    model.write_bytes(whole)
    (newest / "trainer_state.pt").unlink()
    with pytest.warns(UserWarning, match="trainer_state.pt is missing"):
        assert run.latest_checkpoint() == (4, run.checkpoint_dir(4))


def test_an_empty_marker_from_before_manifests_is_still_trusted(tmp_path):
    run = RunDir(tmp_path)
    path = fake_checkpoint(run, 3, complete=False)
    (path / COMPLETE).touch()
    assert run.latest_checkpoint() == (3, path)


def test_resume_with_nothing_to_resume_from_refuses_and_changes_nothing(tmp_path):
    run = RunDir(tmp_path)
    write_metrics(run, range(1, 7))
    unfinished = fake_checkpoint(run, 6, complete=False)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(FileNotFoundError, match=r"no complete, undamaged checkpoint.*step-000006"):
        RunDir(tmp_path, resume=True)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert unfinished.is_dir()


def test_a_metrics_line_cut_off_by_a_crash_is_dropped_on_resume(tmp_path):
    run = RunDir(tmp_path)
    write_metrics(run, range(1, 6), tail='{"step": 6, "lo')
    with pytest.warns(UserWarning, match="unfinished last line"):
        run.truncate_after(4)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4]


def test_a_damaged_line_before_the_last_is_an_error_naming_it(tmp_path):
    run = RunDir(tmp_path)
    write_metrics(run, range(1, 3), tail='{"step": 3, "lo\n{"step": 4}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3 is not JSON"):
        run.truncate_after(2)


def test_pruning_keeps_two_complete_checkpoints_by_default(tmp_path):
    run = RunDir(tmp_path, keep_checkpoints=RunConfig().keep_checkpoints)
    for step in (2, 4, 6):
        fake_checkpoint(run, step)
    fake_checkpoint(run, 7, complete=False)  # a crash's left-over
    newest = fake_checkpoint(run, 8)
    run.prune(newest)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-000006", "step-000008"]


def test_a_second_sigterm_stops_at_once(monkeypatch):
    """Asked again (a second Ctrl-C, or SIGTERM then Ctrl-C), the run must not wait for the step
    (or a wait) to finish."""
    import areal_flow.run

    now = [100.0]
    monkeypatch.setattr(areal_flow.run.time, "monotonic", lambda: now[0])
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
        now[0] += 2.0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_sigterm_relayed_by_torchrun_is_the_same_stop(monkeypatch):
    """scancel sends SIGTERM to every process of the step and torchrun relays its own to the
    ranks: two within milliseconds ask for one graceful stop, not an interrupt."""
    import areal_flow.run

    now = [100.0]
    monkeypatch.setattr(areal_flow.run.time, "monotonic", lambda: now[0])
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        now[0] += 0.005
        os.kill(os.getpid(), signal.SIGTERM)  # no KeyboardInterrupt
        assert stop.requested