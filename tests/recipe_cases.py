"""Runs recipes/gsm8k_grpo.py in this one process on each of several command lines, for tests of
input a run refuses: one interpreter (and one import of torch and transformers) for all of
them, where a process each cost about 6 s. Each case's exit code and everything it printed
(stdout, stderr, a traceback) go to the results file as JSON.

    python tests/recipe_cases.py CASES.json RESULTS.json    # CASES: {"id": [arg, ...], ...}
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(cases_file: str, results_file: str) -> None:
    sys.path.insert(0, str(ROOT / "recipes"))
    import gsm8k_grpo

    from areal_flow import rl_recipes

    results = {}
    for case, args in json.loads(Path(cases_file).read_text()).items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            try:
                sys.argv = ["recipes/gsm8k_grpo.py", *args]
                gsm8k_grpo.main(rl_recipes.cli(gsm8k_grpo.Config, args))
                code = 0
            except SystemExit as stop:  # tyro's and the recipes' usage errors
                code = stop.code if isinstance(stop.code, int) or stop.code is None else 1
                if not isinstance(stop.code, int) and stop.code is not None:
                    print(stop.code, file=sys.stderr)  # as the interpreter prints it at exit
            except Exception:  # noqa: BLE001 - what the process would print, and exit 1
                traceback.print_exc()
                code = 1
        results[case] = {"code": code, "output": printed.getvalue()}
    Path(results_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
