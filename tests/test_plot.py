"""`areal-flow plot`: one panel per logged metric, each run one labelled line."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib", reason="areal-flow plot: pip install 'areal-flow[plot]'")

from areal_flow.cli import main
from areal_flow.plot import DEFAULT_KEYS, plot_runs
from areal_flow.run import RunDir

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = range(1, 5)


def metrics(run: int, step: int) -> dict:
    logged = {"reward/mean": 0.1 * step + run, "loss": 1.0 / step - run,
              "tokens_per_second": 100.0 * step * (run + 1), "rollout/staleness/0": step + run,
              "sample_ids": [step, step + 1]}  # a list: not a curve
    if run == 0:
        logged["eval/accuracy"] = 0.2 * step  # only the first run has this metric
    return logged


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    folders = [root / "baseline", root / "bigger-lr"]
    for run, folder in enumerate(folders):
        run_dir = RunDir(folder)
        for step in STEPS:
            run_dir.log_metrics(step, metrics(run, step))
    return folders


def test_cli_writes_a_png(runs, tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert main(["plot", *map(str, runs), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert str(out) in capsys.readouterr().out


def test_one_panel_per_logged_metric_with_a_line_per_run(runs, tmp_path):
    figure = plot_runs(runs, tmp_path / "curves.png")
    logged = {k for run in (0, 1) for k, v in metrics(run, 1).items() if not isinstance(v, list)}
    assert [ax.get_ylabel() for ax in figure.axes] == [k for k in DEFAULT_KEYS if k in logged]
    for ax in figure.axes:
        assert ax.get_xlabel() == "step"
        key = ax.get_ylabel()
        lines = {line.get_label(): line for line in ax.get_lines()}
        having = [run for run in (0, 1) if key in metrics(run, 1)]
        assert list(lines) == [runs[run].name for run in having]
        assert ax.get_legend() is not None
        for run in having:
            line = lines[runs[run].name]
            assert list(line.get_xdata()) == list(STEPS)
            assert list(line.get_ydata()) == pytest.approx([metrics(run, s)[key] for s in STEPS])


def test_chosen_keys_and_default_output(runs):
    figure = plot_runs(runs[:1], keys=["rollout/staleness/0", "never/logged"])
    assert [ax.get_ylabel() for ax in figure.axes] == ["rollout/staleness/0"]
    assert (runs[0] / "plot.png").read_bytes().startswith(PNG_SIGNATURE)


def test_no_logged_key_is_an_error_listing_what_was_logged(runs, tmp_path):
    with pytest.raises(ValueError, match="reward/mean"):
        plot_runs(runs, tmp_path / "x.png", keys=["never/logged"])


def test_a_folder_without_metrics_names_the_folder(runs, tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="not-a-run"):
        plot_runs([runs[0], empty], tmp_path / "x.png")
    assert main(["plot", str(runs[0]), str(empty), "--out", str(tmp_path / "x.png")]) != 0
    err = capsys.readouterr().err
    assert "not-a-run" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_a_line_still_being_written_is_left_out(tmp_path):
    run = tmp_path / "live"
    RunDir(run).log_metrics(1, {"loss": 0.5})
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')
    figure = plot_runs([run], tmp_path / "x.png", keys=["loss"])
    assert list(figure.axes[0].get_lines()[0].get_xdata()) == [1]


def test_a_broken_line_is_an_error_naming_file_and_line(tmp_path):
    run = tmp_path / "broken"
    RunDir(run).log_metrics(1, {"loss": 0.5})
    with open(run / "metrics.jsonl", "a") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match="metrics.jsonl, line 2"):
        plot_runs([run], tmp_path / "x.png")


def test_a_metric_logged_with_its_interval_is_drawn_with_a_band(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    for step in STEPS:
        run_dir.log_metrics(step, {"eval/accuracy": 0.1 * step,
                                   "eval/accuracy_ci_low": 0.1 * step - 0.05,
                                   "eval/accuracy_ci_high": 0.1 * step + 0.07})
    figure = plot_runs([tmp_path / "run"], keys=["eval/accuracy"])
    (band,) = figure.axes[0].collections
    vertices = band.get_paths()[0].vertices
    for step in STEPS:  # the band spans low..high at each step
        ys = vertices[vertices[:, 0] == step][:, 1]
        assert min(ys) == pytest.approx(0.1 * step - 0.05)
        assert max(ys) == pytest.approx(0.1 * step + 0.07)
