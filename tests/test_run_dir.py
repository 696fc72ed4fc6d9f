"""The run folder keeps what a run has done: checkpoints are trusted only when whole, a damaged
newest one falls back to the one before, --resume with nothing to resume from refuses instead of
starting over, and a metrics file cut off mid-line does not stop a resume."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from areal_flow.run import COMPLETE, RunConfig, RunDir, mark_complete
from areal_flow.stop_request import StopRequest
from tests.helpers import hold_folder

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
    import areal_flow.stop_request

    now = [100.0]
    monkeypatch.setattr(areal_flow.stop_request.time, "monotonic", lambda: now[0])
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
        now[0] += 2.0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_sigterm_relayed_by_torchrun_is_the_same_stop(monkeypatch):
    """scancel sends SIGTERM to every process of the step and torchrun relays its own to the
    ranks: two within milliseconds ask for one graceful stop, not an interrupt."""
    import areal_flow.stop_request

    now = [100.0]
    monkeypatch.setattr(areal_flow.stop_request.time, "monotonic", lambda: now[0])
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        now[0] += 0.005
        os.kill(os.getpid(), signal.SIGTERM)  # no KeyboardInterrupt
        assert stop.requested

# --------------------------------------------------------------------------- what is trusted


def test_a_marker_that_is_not_a_manifest_or_a_file_turned_folder_is_damage(tmp_path):
    run = RunDir(tmp_path)
    fake_checkpoint(run, 2)
    newest = fake_checkpoint(run, 4)
    (newest / COMPLETE).write_text("{half a manifest")
    with pytest.warns(UserWarning, match=f"step-000004: its {COMPLETE} marker is not a manifest"):
        assert run.latest_checkpoint() == (2, run.checkpoint_dir(2))
    mark_complete(newest)
    (newest / "trainer_state.pt").unlink()
    (newest / "trainer_state.pt").mkdir()  # the name is there, the file is not
    with pytest.warns(UserWarning, match="trainer_state.pt is missing"):
        assert run.latest_checkpoint() == (2, run.checkpoint_dir(2))


def test_the_manifest_lists_every_file_below_the_folder_with_its_size_and_hash(tmp_path):
    import hashlib

    run = RunDir(tmp_path)
    path = fake_checkpoint(run, 5)
    (path / "critic" / "dcp").mkdir(parents=True)
    (path / "critic" / "dcp" / "shard").write_bytes(b"x" * 7)
    mark_complete(path)  # marking again: the old marker is not a file of the checkpoint

    def entry(data: bytes) -> dict:
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    assert json.loads((path / COMPLETE).read_text()) == {
        "critic/dcp/shard": entry(b"x" * 7), "hf/model.safetensors": entry(bytes(range(256)) * 40),
        "trainer_state.pt": entry(b"state" * 10)}
    assert sorted(p.name for p in path.iterdir()) == [COMPLETE, "critic", "hf", "trainer_state.pt"]
    assert run.latest_checkpoint() == (5, path)


def test_damage_that_keeps_the_size_falls_back_to_the_checkpoint_before(tmp_path):
    """A flipped byte (bit rot, a bad copy) leaves the size as it was: the hash finds it, and a
    resume takes the checkpoint before instead of failing in the middle of loading."""
    run = RunDir(tmp_path)
    fake_checkpoint(run, 4)
    newest = fake_checkpoint(run, 8)
    model = newest / "hf" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[5000] ^= 0x01
    model.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"step-000008: hf/model.safetensors differs from what "
                                         r"was saved \(its SHA-256 changed\)"):
        assert run.latest_checkpoint() == (4, run.checkpoint_dir(4))


def test_a_manifest_of_sizes_from_before_hashes_is_still_checked_by_size(tmp_path):
    run = RunDir(tmp_path)
    path = fake_checkpoint(run, 3)
    (path / COMPLETE).write_text(json.dumps({"trainer_state.pt": 50,
                                             "hf/model.safetensors": 10240}))
    assert run.latest_checkpoint() == (3, path)
    (path / "trainer_state.pt").write_bytes(b"short")
    with pytest.warns(UserWarning, match="trainer_state.pt has 5 bytes, 50 when it was saved"):
        assert run.latest_checkpoint() is None


@pytest.mark.parametrize(("keep", "left"), [
    (0, ["step-000002", "step-000004", "step-000005", "step-000006"]),  # 0 keeps all
    (1, ["step-000006"]),
    (3, ["step-000002", "step-000004", "step-000006"]),
])
def test_pruning_keeps_the_newest_complete_checkpoints_and_drops_unfinished_ones(
        tmp_path, keep, left):
    run = RunDir(tmp_path, keep_checkpoints=keep)
    for step in (2, 4):
        fake_checkpoint(run, step)
    fake_checkpoint(run, 5, complete=False)
    run.prune(fake_checkpoint(run, 6))
    assert sorted(p.name for p in run.checkpoints.iterdir()) == left


def test_a_new_run_refuses_a_folder_holding_one_and_resume_needs_a_folder(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.resume_from is None
    write_metrics(run, range(1, 3))
    with pytest.raises(FileExistsError, match="already holds a run"):
        RunDir(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="no run folder"):
        RunDir(tmp_path / "elsewhere", resume=True)
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(FileNotFoundError, match=r"\(folders: none\)"):
        RunDir(tmp_path / "run", resume=True)
    path = fake_checkpoint(run, 2)
    assert RunDir(tmp_path / "run", resume=True).resume_from == (2, path)


def test_a_live_runs_folder_is_refused_naming_it_and_free_once_it_dies(tmp_path):
    """A second start or a --resume on a folder a live run holds is refused, naming the
    holder's pid; the kernel drops the lock however the holder ends (SIGKILL here)."""
    from areal_flow.run_lock import RunFolderInUse

    run = RunDir(tmp_path / "run")
    write_metrics(run, range(1, 3))
    fake_checkpoint(run, 2)
    holder = hold_folder(tmp_path / "run", resume=True)
    try:
        for resume in (True, False):
            with pytest.raises(RunFolderInUse, match=rf"in use by a live run: pid {holder.pid} on"):
                RunDir(tmp_path / "run", resume=resume, lock=True)
    finally:
        holder.kill()
        holder.wait()
    resumed = RunDir(tmp_path / "run", resume=True, lock=True)
    assert resumed.resume_from[0] == 2
    with pytest.raises(RunFolderInUse):  # held by this process now, until it closes
        RunDir(tmp_path / "run", resume=True, lock=True)
    resumed.close()
    RunDir(tmp_path / "run", resume=True, lock=True).close()
    RunDir(tmp_path / "run", resume=True)  # without lock=True (tests, tools): no lock taken


def test_a_refused_start_leaves_the_folder_free(tmp_path):
    """The checks after the lock (a run already there, nothing to resume) give it back."""
    run = RunDir(tmp_path / "run")
    write_metrics(run, range(1, 3))
    with pytest.raises(FileExistsError):
        RunDir(tmp_path / "run", lock=True)
    with pytest.raises(FileNotFoundError, match="no complete, undamaged checkpoint"):
        RunDir(tmp_path / "run", resume=True, lock=True)
    fake_checkpoint(run, 2)
    RunDir(tmp_path / "run", resume=True, lock=True).close()


def test_resume_truncates_metrics_and_samples_after_the_checkpoint_step(tmp_path):
    run = RunDir(tmp_path)
    write_metrics(run, range(1, 6), tail="\n")  # a blank line is dropped, not an error
    for step in range(1, 6):
        run.log_samples(step, [{"text": f"s{step}"}])
    run.truncate_after(3)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()] == [1, 2, 3]
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").open()] == [
        {"step": s, "text": f"s{s}"} for s in (1, 2, 3)]


# --------------------------------------------------------------------------- what is logged


class Recorder:
    """A tracker that keeps what it is given."""

    made: list = []

    def __init__(self, path, config, start_step):
        self.opened = (path, config, start_step)
        self.logged: list = []
        self.closed = False
        Recorder.made.append(self)

    def log(self, step, numbers):
        self.logged.append((step, numbers))

    def close(self):
        self.closed = True


def test_metrics_go_to_the_file_whole_and_to_trackers_as_numbers(tmp_path):
    import torch

    from areal_flow.registry import loggers

    loggers.register("test_run_dir.recorder", Recorder)
    Recorder.made.clear()
    run = RunDir(tmp_path)
    config = RunConfig(steps=3, logger=("test_run_dir.recorder",))
    run.write_config(config)
    assert "steps: 3" in (tmp_path / "config.yaml").read_text()
    run.start_loggers(config.logger, config, step=7)
    [tracker] = Recorder.made
    assert tracker.opened[0] == tmp_path and tracker.opened[2] == 7
    assert tracker.opened[1]["steps"] == 3
    run.log_metrics(8, {"loss": 0.5, "n": 3, "done": True, "name": "x", "t": torch.tensor(2.0),
                        "obj": Recorder})
    assert tracker.logged == [(8, {"loss": 0.5, "n": 3.0})]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 8, "loss": 0.5, "n": 3, "done": True, "name": "x", "t": 2.0, "obj": str(Recorder)}
    run.close()
    assert tracker.closed and run.loggers == []


def test_run_config_checks_what_it_can_before_anything_starts():
    from areal_flow.registry import UnknownNameError

    with pytest.raises(ValueError, match="--resume needs --run-dir"):
        RunConfig(resume=True)
    with pytest.raises(UnknownNameError, match="unknown logger 'nope'"):
        RunConfig(logger=("nope",))
    assert RunConfig(resume=True, run_dir="r").resume
    assert RunDir.default_path("grpo").parent.name == "runs"
    assert re.fullmatch(r"grpo-\d{8}-\d{6}", RunDir.default_path("grpo").name)


def test_peak_rss_is_the_kernels_high_water_mark_in_gb():
    from areal_flow.process_memory import peak_rss_gb

    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    high_water_kb = int(status["VmHWM"].split()[0])
    assert peak_rss_gb() == pytest.approx(high_water_kb / 1024**2, rel=0.2)


# --------------------------------------------------------------------------- what is shown


def test_the_plain_display_prints_a_line_per_step_with_metrics_and_eta(monkeypatch):
    import io

    from rich.console import Console

    import areal_flow.live_display
    from areal_flow.live_display import LiveDisplay, _fmt

    now = [100.0]
    monkeypatch.setattr(areal_flow.live_display.time, "monotonic", lambda: now[0])
    display = LiveDisplay(total_steps=10, start_step=2, columns={
        "loss": "loss", "reward": "reward", "task_metrics": "", "eval/task_metrics": "eval "})
    out = io.StringIO()
    display.console = Console(file=out, width=300, force_terminal=False)
    with display:
        now[0] += 90.0
        display.update(5, {"loss": 0.123456, "reward": 12345.6, "task_metrics": ["accuracy"],
                           "accuracy": 0.5, "eval/accuracy": 0.25})
        display.update(6, {"loss": 1.0})  # task metrics listed before still name the columns
    assert out.getvalue().splitlines() == [
        "step 5/10 loss 0.123 reward 12,346 accuracy 0.5 eval accuracy 0.25 eta 2.5 min",
        "step 6/10 loss 1 eta 1.5 min",
    ]
    assert (_fmt(None), _fmt(999.5), _fmt(-2000.0)) == ("-", "1e+03", "-2,000")
    quiet = LiveDisplay(10, 0, {"loss": "loss"}, enabled=False)
    quiet.console = Console(file=io.StringIO(), force_terminal=True)
    with quiet:
        quiet.update(1, {"loss": 1.0})
        quiet.print("hello")
    assert quiet.console.file.getvalue() == ""


def test_a_stop_request_restores_the_handlers_it_replaced(capsys):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopRequest(repeat_window=1.0) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert "SIGINT: stopping after this step" in capsys.readouterr().out


def test_run_config_bounds_and_documented_defaults():
    config = RunConfig()
    assert (config.eval_size, config.eval_every, config.steps, config.save_every,
            config.keep_checkpoints, config.seed, config.resume) == (16, 8, 24, 8, 2, 0, False)
    RunConfig(eval_size=0, keep_checkpoints=0, steps=1, eval_every=1, save_every=1)  # the least
    for field in ("eval_size", "keep_checkpoints"):
        with pytest.raises(ValueError, match=field):
            RunConfig(**{field: -1})
    for field in ("steps", "eval_every", "save_every"):
        with pytest.raises(ValueError, match=field):
            RunConfig(**{field: 0})


def test_the_live_panel_on_a_terminal_shows_the_step_metrics_and_a_sample():
    import io

    from rich.console import Console

    from areal_flow.live_display import LiveDisplay

    display = LiveDisplay(total_steps=10, start_step=0, columns={"loss": "loss"})
    display.console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with display:
        display.update(4, {"loss": 0.5}, sample="older text " * 80 + "THE END")
    text = display.console.file.getvalue()
    for shown in ("4/10", "loss", "0.5", "elapsed", "ETA", "a sample completion", "THE END"):
        assert shown in text
    assert text.count("older text") < 80  # the sample's tail only


def test_a_stop_request_outside_the_main_thread_installs_no_handlers():
    import threading

    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def enter():
        with StopRequest() as stop:
            seen.append((stop.repeat_window, signal.getsignal(signal.SIGTERM)))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [(1.0, before)]


def _captured_panel(monkeypatch, color: bool) -> str:
    """The live panel after step 2 of 62, one minute in, rendered as a terminal would show it."""
    import io

    from rich.console import Console

    import areal_flow.live_display
    from areal_flow.live_display import LiveDisplay

    class Live:  # stands for rich's Live: keeps what it is given
        def update(self, renderable):
            self.renderable = renderable

    monkeypatch.setattr(areal_flow.live_display.time, "monotonic", lambda: 100.0)
    display = LiveDisplay(total_steps=62, start_step=0, columns={"loss": "loss"})
    display._live = live = Live()
    monkeypatch.setattr(areal_flow.live_display.time, "monotonic", lambda: 160.0)
    display.update(2, {"loss": 0.5}, sample="Z" + "y" * 600)  # 601 characters: the last 600 shown
    console = Console(file=io.StringIO(), width=60,
                      **({"force_terminal": True, "color_system": "standard"} if color else
                         {"color_system": None}))
    console.print(live.renderable)
    return console.file.getvalue()


def test_the_live_panel_is_a_right_aligned_table_with_a_bold_header_and_the_samples_tail(
        monkeypatch):
    lines = _captured_panel(monkeypatch, color=False).splitlines()
    assert lines[:2] == [" step  loss  elapsed       ETA ",  # 1 minute for 2 steps: 30 for 60
                         " 2/62   0.5  1.0 min  30.0 min "]
    assert lines[2].startswith("╭─ a sample completion ─")
    assert "Z" not in "".join(lines) and "y" * 20 in "".join(lines)
    assert "\x1b[1mstep\x1b[0m" in _captured_panel(monkeypatch, color=True)


def test_the_plain_line_is_one_unhighlighted_line_however_narrow_the_terminal(monkeypatch):
    import io

    from rich.console import Console

    import areal_flow.live_display
    from areal_flow.live_display import LiveDisplay, _fmt

    now = [100.0]
    monkeypatch.setattr(areal_flow.live_display.time, "monotonic", lambda: now[0])
    display = LiveDisplay(total_steps=62, start_step=1, columns={"loss": "loss"})
    with display:  # not a terminal here: plain lines
        display.console = Console(file=io.StringIO(), width=20, force_terminal=True,
                                  color_system="standard")
        now[0] += 60.0
        display.update(2, {"loss": 0.25})  # one step a minute: 60 to go
        now[0] += 60.0
        display.update(3, {"loss": 0.125})
        display.print("a/long/path/that/must/stay/whole")
    assert display.console.file.getvalue().splitlines() == [
        "step 2/62 loss 0.25 eta 60.0 min", "step 3/62 loss 0.125 eta 59.0 min",
        "a/long/path/that/must/stay/whole"]
    assert (_fmt(1000.4), _fmt(999.0)) == ("1,000", "999")


def test_a_run_folder_is_made_with_its_parents_and_keeps_every_checkpoint_by_default(tmp_path):
    run = RunDir(tmp_path / "a" / "b")
    assert run.resume is False
    assert run.checkpoint_dir(3) == tmp_path / "a" / "b" / "checkpoints" / "step-000003"
    run.close()  # no trackers opened: nothing to close
    for step in (1, 2, 3):
        fake_checkpoint(run, step)
    run.prune(run.checkpoint_dir(3))
    assert len(list(run.checkpoints.iterdir())) == 3
    (run.checkpoints / "step-notes.txt").write_text("a stray file")  # cannot be rmtree'd
    RunDir(tmp_path / "a" / "b", keep_checkpoints=1).prune(run.checkpoint_dir(3))  # no error
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-000003", "step-notes.txt"]
    # a new run in a folder holding checkpoints but no metrics starts from nothing
    assert RunDir(tmp_path / "a" / "b").resume_from is None


def test_truncation_skips_blank_lines_anywhere_and_a_missing_metrics_file(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    run.truncate_after(1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (tmp_path / "metrics.jsonl").unlink()
    run.log_samples(1, [{"a": 1}])
    run.log_samples(2, [{"a": 2}])
    run.truncate_after(1)  # no metrics file: the samples are still truncated
    assert (tmp_path / "samples.jsonl").read_text() == '{"step": 1, "a": 1}\n'


def test_a_stop_request_says_what_happens_and_a_second_one_a_window_later_interrupts(
        monkeypatch, capsys):
    import areal_flow.stop_request

    now = [100.0]
    monkeypatch.setattr(areal_flow.stop_request.time, "monotonic", lambda: now[0])
    with StopRequest(repeat_window=1.0) as stop:
        assert stop.requested is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested is True
        now[0] += 1.0  # exactly the window: a new request
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert capsys.readouterr().out == (
        "\nSIGTERM: stopping after this step (or now, when waiting for a batch) and writing a "
        "checkpoint; again to stop at once\n")


def test_a_note_heads_config_yaml_as_comments_and_the_config_loads_back(tmp_path):
    from areal_flow.config import load

    run = RunDir(tmp_path / "run")
    config = RunConfig(steps=7)
    run.write_config(config, "precision at start:\ntrain.dtype: bfloat16, measured (...)")
    lines = (tmp_path / "run" / "config.yaml").read_text().splitlines()
    assert lines[:2] == ["# precision at start:", "# train.dtype: bfloat16, measured (...)"]
    assert not any(line.startswith("#") for line in lines[2:])
    assert load(RunConfig, tmp_path / "run" / "config.yaml") == config
    run.write_config(config)  # no note: no comment lines
    assert not (tmp_path / "run" / "config.yaml").read_text().startswith("#")


def test_the_tree_memory_counts_the_processes_a_run_started():
    """Reward workers and launched servers are processes of their own: the run's memory metric
    counts them (a child holding 200 MB here, its own child another 100 MB)."""
    import subprocess
    import sys
    import time

    from areal_flow.process_memory import tree_rss_gb

    before = tree_rss_gb()
    grandchild = ("import subprocess, sys, time; x = b'x' * (200 * 2**20); "
                  "subprocess.Popen([sys.executable, '-c', \"x = b'y' * (100 * 2**20); "
                  "print(1, flush=True); import time; time.sleep(60)\"]); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", grandchild], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while tree_rss_gb() - before < 0.29 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tree_rss_gb() - before >= 0.29  # 200 + 100 MB: the grandchild is counted too
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
