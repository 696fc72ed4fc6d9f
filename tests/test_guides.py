"""Every code block of the guides in docs/ runs: `# file: PATH` Python blocks are written, then
the bash blocks run in order from a folder laid out like a clone (recipes/ linked), as a reader
would run them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

GUIDES = ["write_a_reward.md", "write_a_workflow.md", "write_an_algorithm.md"]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)


@pytest.mark.parametrize("guide", GUIDES)
def test_every_block_of_the_guide_runs(guide, tmp_path):
    blocks = BLOCK.findall((ROOT / "docs" / guide).read_text())
    assert blocks, guide
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran = 0
    for language, body in blocks:
        if language == "python":
            first, _, code = body.partition("\n")
            assert first.startswith("# file: "), f"{guide}: a Python block without '# file:'"
            path = tmp_path / first.removeprefix("# file: ").strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
        elif language == "bash":
            result = subprocess.run(["bash", "-e", "-c", body], cwd=tmp_path, env=env,
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, f"{body}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            ran += 1
    assert ran >= 1
