"""The size of the core, as issue 38 measures it: the areal_flow modules that one default GRPO
step on the tiny model loads (`sys.modules` when the recipe ends), plus the SGLang pool, each
counted as `grep -cvE '^\\s*(#|$)'` counts (lines that are neither blank nor a comment).

    python scripts/core_size.py        # one line per module, largest first, then the total

The tiny test model the measure builds its run from is listed but left out of the total."""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = re.compile(r"^\s*(#|$)")
MEASURING_TOOL = "areal_flow.testing.tiny_model"
FOLDER = Path(tempfile.mkdtemp(prefix="core_size_"))
"""The tiny model, its data and the run folder; removed at the end."""


def code_lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if not CODE.match(line))


def report(code: int = 0) -> None:
    """Replaces the recipe's exit: lists what it loaded, then leaves the process at once."""
    import areal_flow.inference.sglang_pool  # noqa: F401 - the pool is core, a GPU run loads it

    loaded = sorted(name for name in sys.modules
                    if name == "areal_flow" or name.startswith("areal_flow."))
    rows = sorted(((code_lines(sys.modules[name].__file__), name) for name in loaded),
                  reverse=True)
    for lines, name in rows:
        print(f"{lines:6d}  {name}" + ("  (the measure's own; not counted)"
                                      if name == MEASURING_TOOL else ""))
    counted = [(lines, name) for lines, name in rows if name != MEASURING_TOOL]
    print(f"core: {len(counted)} modules, {sum(lines for lines, _ in counted):,} code lines")
    sys.stdout.flush()
    shutil.rmtree(FOLDER, ignore_errors=True)
    os._exit(code)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from areal_flow.runtime import distributed
    from areal_flow.testing.tiny_model import build_tiny_model

    model = build_tiny_model(FOLDER / "tiny")
    data = FOLDER / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?",
                                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                            for a in range(6) for b in range(4)))
    distributed.exit_process = report
    sys.argv = ["gsm8k_grpo.py", "--model", str(model), "--dataset", str(data),
                "--run-dir", str(FOLDER / "run"), "--steps", "1", "--rollout.batch-size", "2",
                "--rollout.group-size", "2", "--sampling.max-new-tokens", "8",
                "--eval-size", "0", "--train.compile", "off"]
    runpy.run_path(str(ROOT / "recipes" / "gsm8k_grpo.py"), run_name="__main__")


if __name__ == "__main__":
    main()
