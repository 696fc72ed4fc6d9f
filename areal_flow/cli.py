"""The `areal-flow` command."""

from __future__ import annotations

from typing import Annotated

import tyro
from rich.console import Console
from rich.table import Table

from areal_flow import registry
from areal_flow.registry import RegistryError


def plugins(check: bool = False) -> int:
    """List every registered workflow, reward, algorithm and generation pool with the
    distribution that provides it.

    Args:
        check: Also load each one and show whether it imports (this imports every plugin).
    """
    table = Table(title="areal_flow plugins")
    for column in ("kind", "name", "provided by", "target") + (("status",) if check else ()):
        table.add_column(column)
    failed = 0
    for reg in registry.ALL:
        for row in reg.plugins():
            status = ()
            if check:
                try:
                    reg.get(row.name)
                    status = ("[green]ok[/]",)
                except RegistryError as exc:
                    failed += 1
                    status = (f"[red]{exc}[/]",)
            table.add_row(row.kind, row.name, row.source, row.target, *status)
    Console().print(table)
    return 1 if failed else 0


def check_reward(
    name: Annotated[str, tyro.conf.Positional],
    max_examples: int = 200,
) -> int:
    """Run the reward contract on a registered reward: never raises on arbitrary text, returns
    a finite number within its declared range, deterministic.

    Args:
        name: Registered reward name (or a 'package.module:function' path).
        max_examples: Hypothesis examples to try.
    """
    from areal_flow.testing.contract import check_reward as run_contract

    console = Console()
    try:
        report = run_contract(name, max_examples=max_examples)
    except RegistryError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    console.print(report.summary(), style="green" if report.ok else "red", markup=False)
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    return tyro.extras.subcommand_cli_from_dict(
        {"plugins": plugins, "check-reward": check_reward},
        prog="areal-flow",
        description="areal_flow: asynchronous RL post-training for LLMs.",
        args=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
