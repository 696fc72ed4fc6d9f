"""Helpers for tests that need installed distributions or fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


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
