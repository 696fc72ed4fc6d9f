"""`Session`, the scaffolding of every recipe's loop, in process on the tiny model: checkpoints
when due, at the end, on a stop request and before a failure ends the run; what a resume gets
back. (The recipes' own tests run it end to end in subprocesses: stops by signal, torchrun.)"""

from __future__ import annotations

import json

import pytest

from areal_flow.run import RunConfig
from areal_flow.runtime.engine import TrainConfig, TrainEngine
from areal_flow.session import Session


def steps_of(session: Session, stop_at: int | None = None,
             failure_at: int | None = None) -> list[int]:
    trained = []
    for step in session.steps():
        trained.append(step)
        if step == stop_at:
            session.stop.requested = True  # as Ctrl-C's handler sets it
        session.end_step(step, {"loss": float(step)},
                         failure=ValueError("servers gone") if step == failure_at else None)
    return trained


def checkpoints(run_dir) -> list[int]:
    return sorted(int(p.name.removeprefix("step-"))
                  for p in (run_dir / "checkpoints").glob("step-*"))


def session(tiny_model_dir, run_dir, **options) -> tuple[Session, TrainEngine]:
    cfg = RunConfig(model=str(tiny_model_dir), run_dir=str(run_dir), keep_checkpoints=0,
                    **options)
    s = Session(cfg, "test")
    trainer = TrainEngine(s.model, TrainConfig())
    return s, trainer


def test_checkpoints_when_due_and_at_the_end_and_a_resume_continues_after_the_last(
        tiny_model_dir, tmp_path, capsys):
    s, trainer = session(tiny_model_dir, tmp_path / "run", steps=5, save_every=2)
    with s:
        s.resume(trainer)
        s.saved_also = lambda: {"position": 7}
        s.show(RunConfig(), columns={"loss": "loss"})
        assert steps_of(s) == [0, 1, 2, 3, 4]
    assert checkpoints(tmp_path / "run") == [2, 4, 5]
    assert f"done: {tmp_path / 'run'}" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5]

    s, trainer = session(tiny_model_dir, tmp_path / "run", steps=7, save_every=2, resume=True)
    with s:
        assert s.resume(trainer) == {"position": 7}
        assert s.start == 5
        s.show(RunConfig(), columns={})
        assert steps_of(s) == [5, 6]
    assert checkpoints(tmp_path / "run") == [2, 4, 5, 6, 7]


def test_a_stop_request_ends_the_loop_after_its_step_with_a_checkpoint(tiny_model_dir, tmp_path,
                                                                        capsys):
    s, trainer = session(tiny_model_dir, tmp_path / "run", steps=6, save_every=4)
    with s:
        s.resume(trainer)
        s.show(RunConfig(), columns={})
        assert steps_of(s, stop_at=1) == [0, 1]
    assert checkpoints(tmp_path / "run") == [2]
    out = capsys.readouterr().out
    assert "stopped after step 2; continue with --resume" in out


def test_a_failure_after_a_step_is_raised_after_its_checkpoint(tiny_model_dir, tmp_path):
    s, trainer = session(tiny_model_dir, tmp_path / "run", steps=6, save_every=4)
    with pytest.raises(ValueError, match="servers gone"), s:
        s.resume(trainer)
        s.show(RunConfig(), columns={})
        steps_of(s, failure_at=2)
    assert checkpoints(tmp_path / "run") == [3]


def test_a_step_that_cannot_start_keeps_where_the_run_stands(tiny_model_dir, tmp_path, capsys):
    s, trainer = session(tiny_model_dir, tmp_path / "run", steps=6, save_every=4)
    with s:
        s.resume(trainer)
        s.show(RunConfig(), columns={})
        for step in s.steps():
            if step == 1:  # the rollout was stopped while it waited
                s.stop_before(step)
                break
            s.end_step(step, {})
    assert checkpoints(tmp_path / "run") == [1]
    assert "stopped before step 2; continue with --resume" in capsys.readouterr().out

    s, trainer = session(tiny_model_dir, tmp_path / "run2", steps=6, save_every=4)
    with pytest.raises(TimeoutError, match="no batch"), s:
        s.resume(trainer)
        s.show(RunConfig(), columns={})
        for step in s.steps():
            s.stop_before(step, TimeoutError("no batch"))
    assert checkpoints(tmp_path / "run2") == [0]
