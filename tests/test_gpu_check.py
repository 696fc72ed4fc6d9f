"""scripts/gpu_check.sh: `--cpu` runs every step of the GPU check on the CPU (so it never rots),
and on a GPU machine a wheel missing from the folder stops it at once, naming the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, needs


@needs("peft", "lora")  # one of the check's five tests is LoRA's
def test_the_cpu_run_of_the_gpu_check_passes_every_part_and_reports_numbers(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1",  # `python` is this one,
                               "PATH": f"{Path(sys.executable).parent}{os.pathsep}"  # as in an
                                       f"{os.environ['PATH']}"})  # activated venv
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    tests = report["tests"]["tests"]
    assert len(tests) == 9 and {t["outcome"] for t in tests.values()} == {"passed"}
    assert report["limits"]["gemm_float32_flops"] > 1e9
    assert report["limits"]["copy_bytes_per_s"] > 1e8
    assert 0 < report["decode"]["bandwidth_use"] < 1
    assert report["decode"]["bare_seconds_per_step"] > 0
    recipe = report["recipe"]
    assert recipe["passed"] and recipe["steps"] == 5 and recipe["trained_steps"] >= 1
    assert 0 < recipe["training_mfu"] < 1 and recipe["seconds_per_step"] > 0
    assert 0 < recipe["mfu_of_gemm_peak"] < 1
    assert "recipe:" in done.stdout and "tests: 9/9 passed" in done.stdout


def test_a_wheel_missing_from_the_folder_stops_the_check_naming_the_package(tmp_path):
    (tmp_path / "tyro-1.0.17-py3-none-any.whl").touch()  # the first is there, the second not
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "GPU_WHEELS": str(tmp_path)})
    assert done.returncode == 2
    assert "no wheel of docstring-parser==0.18.0" in done.stderr and "gpu_wheels.sh" in done.stderr


def test_jsonl_data_loads_without_the_datasets_package(tmp_path, monkeypatch):
    """The GPU image has no `datasets`: the check's recipe reads its JSONL rows without it."""
    import sys

    from areal_flow.data.offline import load_rows

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "q1", "answer": "1"}\n{"question": "q2", "answer": "2"}\n')
    assert [row["answer"] for row in load_rows(str(data), "train")] == ["1", "2"]
