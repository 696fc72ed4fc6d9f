"""`benchmarks/run.py` runs a module as a subprocess and collects its table into one report.
(The benchmarks themselves are never run by the suite: they measure, they do not test.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_run_collects_each_modules_table_and_json(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "scheduler", "decode",
         "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "scheduler.json").read_text())
    assert result["benchmark"] == "scheduler" and result["scheduler_episodes_per_s"] > 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# Benchmarks (quick)")
    assert "OMP_NUM_THREADS=1" in summary
    # the machine's limits, measured in the same run: the denominators of MFU and MBU
    assert "GEMM peak (TFLOP/s) float32" in summary and "read bandwidth" in summary
    assert "bf16" in summary.split("\n")[2]  # the CPU's bf16/AMX flags, or that it has neither
    # the module's own printed table, verbatim, under its heading
    table = summary.split("## scheduler", 1)[1]
    assert "| scheduler ep/s | bare gather ep/s |" in table
    assert f"| {result['scheduler_episodes_per_s']:.0f} |" in table
    run = json.loads((tmp_path / "run.json").read_text())
    assert [(m["name"], m["exit"]) for m in run["modules"]] == [("scheduler", 0), ("decode", 0)]
    decode = json.loads((tmp_path / "decode.json").read_text())
    methods = {(r["dtype"], r["batch"], r["method"]) for r in decode["rows"]}
    assert {("float32", 8, "bare"), ("float32", 8, "engine"),
            ("float32", 16, "engine, kv_slots off")} <= methods
    assert all(r["median_ms"] > 0 and 0 < r["mbu"] for r in decode["rows"])
    assert not (tmp_path / "rewards.png").exists()  # no end-to-end run, no curves


def test_time_to_accuracy_reads_the_first_eval_at_or_above_each_threshold(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from time_to_accuracy import thresholds, time_to_threshold

    assert thresholds(0.2, 0.2) is None and thresholds(0.3, 0.1) is None  # nothing learned
    levels = thresholds(1 / 200, 11 / 200)
    assert levels == {0.5: pytest.approx(6 / 200), 0.7: pytest.approx(8 / 200)}
    curve = [(0.0, 1 / 200), (50.0, 4 / 200), (90.0, 6 / 200), (130.0, 5 / 200), (170.0, 11 / 200)]
    # 1/200 + 0.5 * (11/200 - 1/200) is 0.030000000000000002 in floats: 6/200 still reaches it
    assert time_to_threshold(curve, levels[0.5]) == 90.0
    assert time_to_threshold(curve, levels[0.7]) == 170.0  # not 130: the first at or above
    assert time_to_threshold(curve, 12 / 200) is None
