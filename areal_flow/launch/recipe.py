"""A recipe's --dry-run (where each process would run, and the command that starts them) and
its check of --allocation against how the process was started."""

from __future__ import annotations

import functools
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from rich.console import Console

from areal_flow.rl_recipes import RLConfig, usage_error
from areal_flow.launch.allocation import Allocation, AllocationError, launch_command
from areal_flow.launch.slurm import SlurmJob, slurm_layout


def dry_run(cfg: RLConfig) -> None:
    """--dry-run: where each process would run, and the command that starts them."""
    console = Console(soft_wrap=True, highlight=False)
    say = functools.partial(console.print, markup=False)
    if cfg.allocation is None:
        say(f"no --allocation: generation by the {cfg.inference.backend!r} pool as the "
            "--inference options say, training on the ranks torchrun starts")
        return
    allocation = Allocation.parse(cfg.allocation)
    # several nodes: the servers are started by the SLURM job, at its ports
    port_base = attrs.fields(SlurmJob).port_base.default if allocation.nodes > 1 else None
    say(f"--allocation '{allocation}': {allocation.summary()}")
    console.print(allocation.placement(port_base=port_base).table())
    say(f"start it with:\n  {launch_command(allocation, _recipe_command(drop=('--dry-run',)))}")
    if allocation.nodes > 1:
        try:
            fields = slurm_layout(allocation).job_fields()
        except AllocationError as error:
            say(f"(no SLURM job for it: {error})")
            return
        flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in fields.items())
        rest = _recipe_command(drop=("--dry-run", "--allocation", "--model"))[1:]
        say(f"or as a SLURM job, which starts the servers and the training:\n  areal-flow "
            f"slurm --model {shlex.quote(cfg.model or 'MODEL')} {flags} --out job.sh"
            + (f" -- {shlex.join(rest)}" if rest else ""))


def check_launch(cfg: RLConfig) -> None:
    """--allocation against how this process was started: torchrun's world is its training
    ranks, this node has its GPUs, servers on other nodes come as addresses; exit 2, with the
    command to use, when not."""
    if cfg.allocation is None:
        return
    try:
        Allocation.parse(cfg.allocation).check_launch(
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            visible_gpus=torch.cuda.device_count(),
            has_addresses=bool(cfg.inference.addresses or cfg.inference.addresses_file),
            command=_recipe_command(drop=()))
    except AllocationError as error:
        usage_error(error)


def _recipe_command(drop: Sequence[str]) -> list[str]:
    """This recipe's command line without the options in `drop` (each with its value, except
    --dry-run), its path relative to the working folder when inside it."""
    script, *rest = sys.argv
    kept, words = [], iter(rest)
    for arg in words:
        flag = arg.split("=", 1)[0]
        if flag not in drop:
            kept.append(arg)
        elif "=" not in arg and flag != "--dry-run":
            next(words, None)  # the option's value
    path = Path(script).resolve()
    if path.is_relative_to(Path.cwd()):
        script = str(path.relative_to(Path.cwd()))
    return [script, *kept]
