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
    chosen = {r["method"]: r["attention"] for r in decode["rows"] if r["batch"] == 8}
    assert chosen["engine, attention matmul"] == "matmul" and chosen["bare"] is None
    assert chosen["engine, attention sdpa"] == "sdpa" and chosen["engine"] in ("sdpa", "matmul")
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


def test_time_to_accuracy_over_seeds_takes_thresholds_from_trls_mean_gain(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from time_to_accuracy import compare

    def side(points):
        return {"curve": [{"train_s": s, "accuracy": a} for s, a in points]}

    runs = [  # start 0.2 everywhere; TRL ends at 0.4, 0.3 and 0.2: a mean gain of 0.1
        {"areal_flow": side([(0, 0.2), (10, 0.3), (20, 0.35)]),
         "trl": side([(0, 0.2), (50, 0.22), (100, 0.4)])},
        {"areal_flow": side([(0, 0.2), (10, 0.25), (20, 0.26)]),
         "trl": side([(0, 0.2), (50, 0.3), (100, 0.3)])},
        {"areal_flow": side([(0, 0.2), (10, 0.2), (20, 0.3)]),
         "trl": side([(0, 0.2), (50, 0.2), (100, 0.2)])},
    ]
    result = compare(runs)
    assert result["trl_mean_final_accuracy"] == pytest.approx(0.3)
    half, most = result["thresholds"]
    assert (half["fraction"], half["accuracy"]) == (0.5, pytest.approx(0.25))
    assert half["areal_flow_s"] == [10, 10, 20] and half["trl_s"] == [100, 50, None]
    # medians: a run that never got there is later than every other
    assert (half["areal_flow_median_s"], half["trl_median_s"]) == (10, 100)
    assert half["ratio_of_medians"] == pytest.approx(10.0)
    assert (most["fraction"], most["accuracy"]) == (0.7, pytest.approx(0.27))
    assert most["areal_flow_s"] == [10, None, 20] and most["trl_s"] == [100, 50, None]
    assert most["areal_flow_median_s"] == 20 and most["ratio_of_medians"] == pytest.approx(5.0)
    # TRL's median run never got there (mean final 0.4, 70 % at 0.34): all of its training
    # (median 100 s) over areal_flow's median bounds the ratio from below
    runs[0]["trl"] = side([(0, 0.2), (50, 0.2), (100, 0.8)])
    runs[1]["trl"] = side([(0, 0.2), (50, 0.2), (120, 0.2)])
    runs[1]["areal_flow"] = side([(0, 0.2), (10, 0.4), (20, 0.4)])
    most = compare(runs)["thresholds"][1]
    assert most["accuracy"] == pytest.approx(0.34)
    assert most["trl_s"] == [100, None, None] and most["areal_flow_s"] == [20, 10, None]
    assert most["ratio_of_medians"] is None and most["ratio_lower_bound"] == pytest.approx(5.0)
    # nothing learned on TRL's side: no threshold
    for run in runs:
        run["trl"] = side([(0, 0.2), (100, 0.2)])
    assert compare(runs)["thresholds"] is None


def test_reasoning_gym_seeds_counts_a_seed_as_learned_only_with_its_gain_and_interval(
        monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from reasoning_gym_seeds import read_run, verdict

    def run(final: float, ci_low: float, entropies=(2.0, 1.0, 0.5)) -> dict:
        folder = tmp_path / f"{final}-{ci_low}-{entropies[-1]}"
        folder.mkdir()
        (folder / "config.yaml").write_text("# precision\nseed: 3\nsteps: 10\n")
        lines = [{"step": 0, "eval/accuracy": 0.3, "eval/accuracy_ci_low": 0.24,
                  "eval/accuracy_ci_high": 0.37}]
        for step, entropy in enumerate(entropies, 1):  # a step's line, then its eval's
            lines.append({"step": step, "entropy": entropy, "reward/mean": 0.5, "lr": 1e-5,
                          "reward/flat_group_fraction": 0.25, "seconds/step": 6.0})
        lines.append({"step": len(entropies), "eval/accuracy": final,
                      "eval/accuracy_ci_low": ci_low, "eval/accuracy_ci_high": final + 0.07})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return read_run(folder)

    learned = run(0.38, 0.31)
    assert learned["seed"] == 3 and [c["step"] for c in learned["curve"]] == [0, 3]
    v = verdict(learned)
    assert v["learned"] and v["gain"] == pytest.approx(0.08) and not v["collapsed"]
    assert v["minutes"] == pytest.approx(0.3) and v["entropy_min"] == 0.5
    assert not verdict(run(0.37, 0.31))["learned"]  # +7 points
    assert not verdict(run(0.40, 0.29))["learned"]  # +10, but the interval reaches the start
    assert verdict(run(0.40, 0.33, entropies=(2.0, 1.0, 0.39)))["collapsed"]  # < 20 % of 2.0
