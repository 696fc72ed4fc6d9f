"""Curves of one or more runs' `metrics.jsonl`, one panel per metric, runs overlaid."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import tyro

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ImportError:
    raise ModuleNotFoundError("areal-flow plot draws with matplotlib: pip install "
                              "'areal-flow[plot]'") from None

DEFAULT_KEYS = (
    # reward
    "reward/mean", "reward/std", "eval/reward",
    # accuracy: strict and lenient (eval/accuracy drawn with its 95% interval)
    "accuracy", "accuracy_lenient", "format", "eval/accuracy", "eval/accuracy_lenient",
    "eval/format",
    # what GRPO can learn from, and response length
    "reward/flat_group_fraction", "response_length/mean", "response_length/max",
    "response_length/clip_fraction", "eval/response_length", "work_shown", "eval/work_shown",
    # how far the policy moved: KL, clipping, importance weights
    "approx_kl", "kl_ref", "clip_fraction", "capped_fraction",
    "importance_weight_mean", "importance_weight_max",
    "entropy", "entropy_coef",
    # losses (critic/value_loss: PPO, nll: SFT)
    "loss", "critic/value_loss", "nll", "eval/nll", "grad_norm",
    # throughput
    "tokens_per_second", "seconds/step",
    "staleness/mean",
)
"""The panels drawn when no keys are given, in this order (those no run logged are left out)."""

COLUMNS = 3


def read_metrics(run_dir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """A run's numeric metrics: key -> (steps, values). Lists (e.g. sample_ids) are skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in run folder {run_dir}: expected {path}")
    curves: dict[str, tuple[list[int], list[float]]] = {}
    # the text after the last newline is a line still being written (a run in progress)
    for number, line in enumerate(path.read_text().split("\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not JSON ({exc})") from None
        for key, value in record.items():
            # bool is an int to Python but not a curve
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                steps, values = curves.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(float(value))
    return curves


def output_path(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Where `plot_runs` writes: `out`, or plot.png in the first run folder."""
    return Path(out) if out is not None else Path(run_dirs[0]) / "plot.png"


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None,
              keys: Sequence[str] | None = None) -> Figure:
    """Draw every metric of `keys` (default `DEFAULT_KEYS`) that some run logged, each run a line
    labelled by its folder name, and save the figure as `out` (default: plot.png in the first
    run folder)."""
    if not run_dirs:
        raise ValueError("'run_dirs' must name at least one run folder")
    labels = [Path(d).resolve().name for d in run_dirs]
    if len(set(labels)) < len(labels):  # same folder name in different places: tell them apart
        labels = [str(d) for d in run_dirs]
    runs = {label: read_metrics(d) for label, d in zip(labels, run_dirs)}
    wanted = list(keys) if keys else list(DEFAULT_KEYS)
    present = [k for k in wanted if any(k in curves for curves in runs.values())]
    if not present:
        logged = sorted({k for curves in runs.values() for k in curves})
        raise ValueError(f"none of the keys {wanted} is in these runs; they logged: {logged}")

    columns = min(COLUMNS, len(present))
    rows = math.ceil(len(present) / columns)
    figure = Figure(figsize=(5 * columns, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # Agg draws without a display; no pyplot, so no global figure state
    for index, key in enumerate(present, start=1):
        axes = figure.add_subplot(rows, columns, index)
        for name, curves in runs.items():
            if key in curves:
                steps, values = curves[key]
                line, = axes.plot(steps, values, label=name,
                                  marker="." if len(steps) < 30 else None)
                low, high = curves.get(f"{key}_ci_low"), curves.get(f"{key}_ci_high")
                if low and high and low[0] == steps == high[0]:  # an interval logged with it
                    axes.fill_between(steps, low[1], high[1], color=line.get_color(), alpha=0.15,
                                      linewidth=0)
        axes.set_xlabel("step")
        axes.set_ylabel(key)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")

    out = output_path(run_dirs, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return figure


def command(
    run_dirs: Annotated[tuple[str, ...], tyro.conf.Positional,
                        tyro.conf.arg(metavar="RUN_DIR [RUN_DIR ...]")],
    out: str | None = None,
    keys: tuple[str, ...] = (),
) -> int:
    """Plot the metrics.jsonl curves of one or more run folders into one PNG, runs overlaid.

    Args:
        run_dirs: Run folders (each with a metrics.jsonl).
        out: PNG file to write; default plot.png in the first run folder.
        keys: Metrics to plot (e.g. reward/mean loss); default: areal_flow.plot.DEFAULT_KEYS.
    """
    from areal_flow.cli import say

    try:
        plot_runs(run_dirs, out, keys=keys or None)
    except (FileNotFoundError, ValueError) as exc:
        say(str(exc), error=True)
        return 2
    say(f"wrote {output_path(run_dirs, out)}")
    return 0
