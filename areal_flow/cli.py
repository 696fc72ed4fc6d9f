"""The `areal-flow` command."""

from __future__ import annotations

from typing import Annotated, Literal

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


def serve(
    model: str,
    port: int,
    host: str = "127.0.0.1",
    dtype: Literal["float32", "bfloat16"] = "float32",
    max_batch_size: int = 64,
    seed: int = 0,
) -> int:
    """Serve a model with the local engine behind SGLang's HTTP protocol (the part areal_flow
    uses), for CPU machines and tests where SGLang cannot run. Ready when GET /health answers 200.

    Args:
        model: A save_pretrained folder (or hub id when online).
        port: Port to listen on.
        host: Address to listen on.
        dtype: Weights' dtype.
        max_batch_size: Most sequences decoded together; more requests wait in a queue.
        seed: Seeds the sampling of requests that carry no sampling_seed.
    """
    from areal_flow.inference.server import serve as run_server

    run_server(model, host=host, port=port, dtype=dtype, max_batch_size=max_batch_size, seed=seed)
    return 0


def main(argv: list[str] | None = None) -> int:
    return tyro.extras.subcommand_cli_from_dict(
        {"plugins": plugins, "check-reward": check_reward, "serve": serve},
        prog="areal-flow",
        description="areal_flow: asynchronous RL post-training for LLMs.",
        args=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
