"""`benchmarks/run.py` runs a module as a subprocess and collects its table into one report.
(The benchmarks themselves are never run by the suite: they measure, they do not test.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_run_collects_each_modules_table_and_json(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "scheduler",
         "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "scheduler.json").read_text())
    assert result["benchmark"] == "scheduler" and result["scheduler_episodes_per_s"] > 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# Benchmarks (quick)")
    assert "OMP_NUM_THREADS=1" in summary
    # the module's own printed table, verbatim, under its heading
    table = summary.split("## scheduler", 1)[1]
    assert "| scheduler ep/s | bare gather ep/s |" in table
    assert f"| {result['scheduler_episodes_per_s']:.0f} |" in table
    run = json.loads((tmp_path / "run.json").read_text())
    assert [(m["name"], m["exit"]) for m in run["modules"]] == [("scheduler", 0)]
    assert not (tmp_path / "rewards.png").exists()  # no end-to-end run, no curves
