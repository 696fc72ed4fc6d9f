"""The `areal-flow` command."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Literal

import tyro
from rich.console import Console
from rich.table import Table

from areal_flow import registry
from areal_flow.launch.allocation import Allocation, cli_arg
from areal_flow.evaluation import EvalConfig
from areal_flow.registry import RegistryError
from areal_flow.launch.slurm import SlurmJob, sbatch_script


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
        config = reg.spec(name).config
        if config is None:
            print(f"{reg.kind} {name} takes no options")
            continue
        how = "--workflow-config '{\"field\": value, ...}' (or a YAML file)" \
            if reg is registry.workflows else f"--algorithm {name} --algorithm.<field> value"
        if reg is registry.workflows:
            print("In --workflow-config each option below is a key, with underscores "
                  "(--question-field: question_field).")
        try:
            tyro.cli(config, args=["--help"], prog=f"{reg.kind} {name}: {how}")
        except SystemExit:  # tyro exits after printing the help
            pass
    return 0


def check_reward(
    name: Annotated[str, tyro.conf.Positional],
    max_examples: int = 200,
    answers: tuple[Literal["####", "boxed", "answer_tag", "json"], ...] = (),
    answer_field: str = "answer",
    examples: str | None = None,
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
    """
    from areal_flow.testing.contract import check_reward as run_contract
    from areal_flow.testing.strategies import answered

    console = Console()
    if answers and examples:
        console.print("[red]--answers and --examples: give one of them[/]")
        return 2
    try:
        strategy = answered(answers, answer_field=answer_field) if answers else \
            _attribute(examples) if examples else None
        report = run_contract(name, max_examples=max_examples, examples=strategy)
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


def serve(
    model: str,
    port: int,
    host: str = "127.0.0.1",
    dtype: Literal["auto", "float32", "bfloat16"] = "auto",
    max_batch_size: int = 64,
    seed: int = 0,
    device: str = "auto",
    weight_version: int | None = None,
    health_delay: float = 0.0,
    health_timeout: float = 20.0,
    enable_lora: bool = False,
) -> int:
    """Serve a model with the local engine behind SGLang's HTTP protocol (the part areal_flow
    uses), for CPU machines and tests where SGLang cannot run. Ready when GET /health answers 200.

    Args:
        model: A save_pretrained folder (or hub id when online).
        port: Port to listen on.
        host: Address to listen on.
        dtype: Weights' dtype; auto: the faster for decoding this model here (bf16 on a GPU).
        max_batch_size: Most sequences decoded together; more requests wait in a queue.
        seed: Seeds the sampling of requests that carry no sampling_seed.
        device: auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N.
        weight_version: The version of the weights loaded at start; without it the server
            reports "default", as SGLang does.
        health_delay: Seconds a health check waits before its one-token generation (SGLang: 1).
        health_timeout: Seconds after which a health check (e.g. held by a pause) answers 503.
        enable_lora: Serve LoRA adapters (/load_lora_adapter, /unload_lora_adapter, and
            lora_path on /generate), as SGLang's --enable-lora.
    """
    from areal_flow.protocol_server.app import serve as run_server

    run_server(model, host=host, port=port, dtype=dtype, max_batch_size=max_batch_size, seed=seed,
               device=device, weight_version=weight_version, health_delay=health_delay,
               health_timeout=health_timeout, enable_lora=enable_lora)
    return 0


def plot(
    run_dirs: Annotated[tuple[str, ...], tyro.conf.Positional,
                        tyro.conf.arg(metavar="RUN_DIR [RUN_DIR ...]")],
    out: str | None = None,
    keys: tuple[str, ...] = (),
) -> int:
    """Plot the metrics.jsonl curves of one or more run folders into one PNG, runs overlaid.

    Args:
        run_dirs: Run folders (each with a metrics.jsonl).
        out: PNG file to write; default plot.png in the first run folder.
        keys: Metrics to plot (e.g. reward/mean loss); default: areal_flow.plot.DEFAULT_KEYS.
    """
    from areal_flow.plot import output_path, plot_runs

    try:
        plot_runs(run_dirs, out, keys=keys or None)
    except (FileNotFoundError, ValueError) as exc:
        _say(str(exc), error=True)
        return 2
    _say(f"wrote {output_path(run_dirs, out)}")
    return 0


def slurm(job: Annotated[SlurmJob, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name="")],
          out: str | None = None,
          allocation: Annotated[Allocation | None, cli_arg()] = None) -> int:
    """Print (or write with --out) an sbatch script for multi-node training: generation servers
    (SGLang, or areal-flow serve on CPU nodes) on the first server_nodes nodes, torchrun on the
    rest; the training reads the servers from an addresses file they are appended to as they come
    up. Run under a real SLURM on CPU nodes only (tests/test_slurm_real.py); UNTESTED with GPUs
    and SGLang.

    Args:
        out: File to write the script to; printed when not given.
        allocation: Where everything runs, as the recipes take it ('generation: 4 servers x tp
            2, training: 16 ranks on 3 nodes x 8 gpus'): sets --nodes, --server-nodes,
            --gpus-per-node, --servers-per-node (and --server-program on cpu nodes).
    """
    import attrs

    from areal_flow.launch.allocation import AllocationError
    from areal_flow.launch.slurm import slurm_layout

    if allocation is not None:
        defaults = attrs.fields_dict(SlurmJob)
        given = [f"--{name.replace('_', '-')}" for name in SLURM_ALLOCATION_FIELDS
                 if getattr(job, name) != defaults[name].default]
        if given:
            _say(f"--allocation '{allocation}' already says {', '.join(given)}: give one or "
                 "the other", error=True)
            return 2
        try:
            job = attrs.evolve(job, **slurm_layout(allocation).job_fields())
        except AllocationError as exc:
            _say(f"--allocation: {exc}", error=True)
            return 2
    try:
        script = sbatch_script(job)
    except ValueError as exc:
        _say(str(exc), error=True)
        return 2
    if out is None:
        print(script, end="")
        return 0
    Path(out).write_text(script)
    _say(f"wrote {out}; submit it with: sbatch {out}")
    return 0


SLURM_ALLOCATION_FIELDS = ("nodes", "server_nodes", "gpus_per_node", "servers_per_node",
                           "server_program")
"""The `areal-flow slurm` options an --allocation sets (given with it, they are refused)."""


def eval_(cfg: EvalConfig) -> int:
    """`areal-flow eval` (its options: `EvalConfig`, which tyro builds and checks)."""
    from areal_flow import evaluation

    try:  # names, rows and the model's config are checked before any weights load
        plan = evaluation.prepare(cfg)
    except (RegistryError, ValueError, OSError, ImportError) as exc:
        _say(f"areal-flow eval: {exc}", error=True)
        return 2
    console = Console()
    summary = evaluation.run(plan, console)
    _say(evaluation.headline(summary))
    console.print(evaluation.table(summary))
    _say(f"wrote {plan.out} and {evaluation.summary_path(plan.out)} in "
         f"{summary['seconds']:g} s (peak memory {summary['peak_rss_gb']:.1f} GB)")
    return 0


def _say(message: str, *, error: bool = False) -> None:
    # paths and messages are printed as they are: no markup, no line breaks inserted
    Console(stderr=error).print(message, style="red" if error else None, markup=False,
                                highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    try:
        result = tyro.extras.subcommand_cli_from_dict(
            {"plugins": plugins, "check-reward": check_reward, "serve": serve, "plot": plot,
             "slurm": slurm, "eval": EvalConfig},
            prog="areal-flow",
            description="areal_flow: asynchronous RL post-training for LLMs.",
            args=argv,
        )
        return eval_(result) if isinstance(result, EvalConfig) else result
    except ModuleNotFoundError as error:  # an optional part's extra is not installed: one line
        if "areal-flow[" not in str(error):
            raise
        print(f"areal-flow: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
