"""`areal-flow check-reward`: the reward contract kit on a registered reward."""

from __future__ import annotations

from typing import Annotated, Literal

import tyro


def command(
    name: Annotated[str, tyro.conf.Positional],
    max_examples: int = 200,
    answers: tuple[Literal["####", "boxed", "answer_tag", "json"], ...] = (),
    answer_field: str = "answer",
    examples: str | None = None,
    seed: int | None = None,
) -> int:
    """Run the reward contract on a registered reward: never raises on arbitrary text, returns
    a finite number within its declared range, deterministic, returns within its timeout; its
    `metrics`, if declared, on the same examples: never raise, {name: finite number}.

    Args:
        name: Registered reward name (or a 'package.module:function' path).
        max_examples: Hypothesis examples to try.
        answers: Completions that state an answer in these syntaxes, with the reference as
            `answer` (areal_flow.testing.strategies.answered), so the check reaches the
            reward's main path; default: hostile text.
        answer_field: The keyword that --answers passes the reference as (the reward's
            parameter name, e.g. target).
        examples: A 'package.module:name' of your own hypothesis strategy of
            (completion, kwargs) pairs.
        seed: Draw the same examples every run (default: new ones each run).
    """
    from rich.console import Console

    from areal_flow.registry import RegistryError
    from areal_flow.testing.contract import check_reward as run_contract
    from areal_flow.testing.strategies import answered

    console = Console()
    if answers and examples:
        console.print("[red]--answers and --examples: give one of them[/]")
        return 2
    try:
        strategy = answered(answers, answer_field=answer_field) if answers else \
            _attribute(examples) if examples else None
        report = run_contract(name, max_examples=max_examples, examples=strategy,
                              seed=seed)
    except (RegistryError, ImportError, AttributeError) as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    console.print(report.summary(), style="green" if report.ok else "red", markup=False)
    return 0 if report.ok else 1


def _attribute(path: str):
    """The object at 'package.module:name'."""
    import importlib

    module, _, attribute = path.partition(":")
    if not attribute:
        raise ImportError(f"--examples {path!r}: expected 'package.module:name'")
    return getattr(importlib.import_module(module), attribute)
