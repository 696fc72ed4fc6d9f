"""What every benchmark module shares: the command line (run, print the table, write the JSON)
and the markdown table they print, which `run.py` collects into one report."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path


def main(doc: str, run: Callable[[bool], dict], show: Callable[[dict], None], name: str) -> None:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small configuration only")
    parser.add_argument("--out", default=f"benchmarks/results/{name}.json")
    args = parser.parse_args()
    result = run(args.quick)
    show(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)
