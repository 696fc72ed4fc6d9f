"""The `areal-flow` command: its subcommands are the `areal_flow.commands` registry.

Each part that has a command announces it under that entry-point group (`plot` in
`areal_flow.plot`, `slurm` in `areal_flow.launch.slurm`, ...), and so can a plugin distribution.
A command is a function (its parameters are the options; it returns the exit status) or a
config class whose instance is called for the exit status (`EvalConfig`: tyro then shows a
ValueError of its checks as bad input).
Running one command loads that command alone; `areal-flow --help` loads them all to list them, and
shows one that cannot load (its extra not installed) with the reason.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import tyro
from rich.console import Console
from rich.table import Table

from areal_flow import registry
from areal_flow.registry import RegistryError


def plugins(check: bool = False, show: str | None = None) -> int:
    """List every registered workflow, reward, algorithm and generation pool with the
    distribution that provides it.

    Args:
        check: Also load each one and show whether it imports (this imports every plugin).
        show: A workflow's or algorithm's name: the options of its config class, with their
            defaults and help (what --workflow-config or --algorithm.<field> sets).
    """
    if show is not None:
        return _show_options(show)
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
    console = Console()
    if not console.is_terminal:  # a pipe or a file: rows at full width, never cut at 80 columns
        console = Console(width=10_000)
    console.print(table)
    return 1 if failed else 0


def _show_options(name: str) -> int:
    """`plugins --show NAME`: the config class of the workflow or algorithm `name`, as tyro's
    help shows it (each field, its type, default and docstring)."""
    kinds = [reg for reg in (registry.workflows, registry.algorithms) if name in reg]
    if not kinds:
        print(f"areal-flow plugins --show: no workflow or algorithm {name!r}; known: "
              f"{', '.join(registry.workflows.names() + registry.algorithms.names())}",
              file=sys.stderr)
        return 2
    for reg in kinds:
        registry.show_options(reg, name)
    return 0


def say(message: str, *, error: bool = False) -> None:
    """A command's message, printed as it is: no markup, no line breaks inserted (paths)."""
    Console(stderr=error).print(message, style="red" if error else None, markup=False,
                                highlight=False, soft_wrap=True)


def _reason(error: RegistryError) -> str:
    return str(error.__cause__ or error)  # e.g. "... pip install 'areal-flow[plot]'"


def _listed(name: str) -> Callable[..., Any]:
    """The command `name` as `areal-flow --help` lists it: one that cannot load is listed with
    the reason."""
    try:
        return registry.commands.get(name)
    except RegistryError as error:
        def unavailable() -> None:
            pass

        unavailable.__doc__ = f"(cannot load: {_reason(error)})"
        return unavailable


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = registry.commands.names()
    try:
        if argv and argv[0] in names:  # one command: load it alone
            try:
                command = registry.commands.get(argv[0])
            except RegistryError as error:  # e.g. its extra is not installed
                say(f"areal-flow {argv[0]}: {_reason(error)}", error=True)
                return 2
            built = tyro.cli(command, args=argv[1:], prog=f"areal-flow {argv[0]}")
        else:  # help, or a wrong name: list them all
            built = tyro.extras.subcommand_cli_from_dict(
                {name: _listed(name) for name in names}, prog="areal-flow",
                description="areal_flow: asynchronous RL post-training for LLMs.", args=argv)
        return built() if callable(built) else built  # a config class's instance runs now
    except ModuleNotFoundError as error:  # an optional part's extra is not installed: one line
        if "areal-flow[" not in str(error):
            raise
        print(f"areal-flow: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
