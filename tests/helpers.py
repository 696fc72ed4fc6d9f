"""Helpers for tests that need installed distributions, fresh interpreters or recipe runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def needs(module: str, extra: str):
    """Skip the test where `module` is not installed, naming the extra that installs it."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module}: pip install 'areal-flow[{extra}]'")


def make_distribution(
    root: Path,
    dist_name: str,
    entry_points: dict[str, dict[str, str]],
    modules: dict[str, str] | None = None,
) -> Path:
    """Lay out an installed distribution the way pip leaves one: modules plus a .dist-info folder
    whose entry_points.txt announces `entry_points` ({group: {name: "module:attr"}})."""
    root.mkdir(parents=True, exist_ok=True)
    for module, source in (modules or {}).items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def run_python(code: str, *paths: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that also sees `paths` (like installed site folders)."""
    return _run([sys.executable, "-c", textwrap.dedent(code)], paths, check)


def run_cli(*args: str, paths: tuple[Path, ...] = (), check: bool = True):
    return _run([sys.executable, "-m", "areal_flow.cli", *args], paths, check)


def _run(cmd: list[str], paths, check: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="250", PYTHONPATH=os.pathsep.join(map(str, paths)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


ROOT = Path(__file__).resolve().parents[1]


def run_recipe(recipe: str, args: list[str], *, launcher: tuple[str, ...] = (),
               check: bool = True, timeout: float = 300,
               paths: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """`python recipes/<recipe>.py ARGS` from the repo root (tests' rewards importable, and
    whatever is installed in `paths`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(map(str, (*paths, ROOT, *filter(None, [
               os.environ.get("PYTHONPATH")]))))}  # the GPU check's site folder stays in reach
    result = subprocess.run([*(launcher or (sys.executable,)), str(ROOT / "recipes" / recipe),
                             *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


def run_recipe_cases(cases: dict[str, list[str]], work: Path) -> dict[str, tuple[int, str]]:
    """`recipes/gsm8k_grpo.py` on each command line of `cases`, all in one process
    (tests/recipe_cases.py; a process each costs ~6 s of imports): case -> (exit code,
    everything it printed). For input a run refuses before it trains."""
    (work / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "recipe_cases.py"),
                           str(work / "cases.json"), str(work / "results.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(done.stderr[-3000:])
    return {case: (r["code"], r["output"])
            for case, r in json.loads((work / "results.json").read_text()).items()}


def metrics(run_dir: Path) -> list[dict]:
    """The run folder's metrics.jsonl lines."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_finite(run_dir: Path, keys: tuple[str, ...]) -> None:
    """Every trained step logged each of `keys` as a finite number (NaN passes a key check)."""
    import math

    trained = [m for m in metrics(run_dir) if m["step"] > 0]
    assert trained
    for m in trained:
        for key in keys:
            assert math.isfinite(m[key]), (m["step"], key, m[key])


class ScriptedPool:
    """A generation pool for workflow tests: replies with the next scripted (text, finish
    reason), a "stop" reply ending with EOS, and keeps every prompt it was given."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, iter(replies), []

    async def generate(self, request):
        self.prompts.append(list(request.input_ids))
        text, finish = next(self.replies)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids += [self.tokenizer.eos_token_id] if finish == "stop" else []
        from areal_flow.types import Completion

        return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[3] * len(ids),
                          finish_reason=finish, text=text)


def install_plugin(name: str, into: Path) -> Path:
    """examples/plugins/<name> installed for real with pip into the folder `into`."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    str(into), str(ROOT / "examples" / "plugins" / name)], check=True)
    return into


def plugin_rows(site: Path, word: str) -> list[list[str]]:
    """The cells of `areal-flow plugins`' rows that mention `word`, with `site` installed."""
    rows = [line for line in run_cli("plugins", paths=(site,)).stdout.splitlines()
            if word in line]
    return [[c.strip() for c in row.strip("│ ").split("│")] for row in rows]


HOLD = """
import sys, time
from areal_flow.run import RunDir
run = RunDir(sys.argv[1], resume=len(sys.argv) > 2, lock=True)
print("holding", flush=True)
time.sleep(120)
"""


def hold_folder(folder, *, resume: bool = False):
    """A live run in another process, holding `folder` (its pid is the lock's holder)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), *(["r"] * resume)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding", proc.stderr.read()
    return proc
