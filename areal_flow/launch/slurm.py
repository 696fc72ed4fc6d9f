"""An sbatch script for multi-node training: generation servers on some nodes, torchrun on the rest.

The servers are SGLang (GPU nodes) or `areal-flow serve` (``--server-program areal-flow``: the
SGLang protocol over our local engine, for CPU nodes; ``--gpus-per-node 0`` asks SLURM for no
GPUs and runs one training rank per node). The servers are started by the same command builders as
`SGLangLauncher` (`sglang_command`, `serve_command`); each server's ``host:port`` is appended to an
addresses file once it answers ``GET /health``, and the training's `SGLangPool` re-reads that
file, so servers that come up late join while it runs.

Tested under a real SLURM (Debian's slurm-wlm 22.05, started by `scripts/slurm_local.sh`: three
``slurmd -N`` on one machine emulate three nodes) by ``tests/test_slurm_real.py``: CPU nodes,
``--server-program areal-flow``; one server node with one training node, and with two training
nodes (torchrun's c10d rendezvous across nodes, a world of 2); a short GRPO run end to end; and
``scancel`` mid-run leaving a checkpoint that a second job resumes from.

UNTESTED (only the stand-ins of ``tests/test_slurm.py`` run these: fake srun, scontrol, curl,
torchrun): GPUs (the ``--gpus-per-node`` request, ``CUDA_VISIBLE_DEVICES`` per server, several
ranks per node); SGLang itself as the server; several servers per node and several server nodes
(emulated nodes share one machine, so their servers' ports would collide); nodes that are
separate machines (name resolution between them, the shared filesystem the job folder, weights
and run folder need, firewalls between the nodes' ports).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Annotated, Literal

import attrs
import tyro

from areal_flow.launch.allocation import Allocation, AllocationError, cli_arg, repair

RENDEZVOUS_PORT = 29500
HEALTH_POLL_SECONDS = 2
"""How often the job polls a starting server's /health (a curl: cheap)."""


@attrs.frozen(kw_only=True)
class SlurmJob:
    """What the generated job runs (see `sbatch_script`)."""

    model: str
    """HF folder or hub id, read by the servers and the training ranks (use a shared path)."""
    nodes: int = 1
    """Training nodes (torchrun, gpus_per_node ranks each; one on CPU nodes)."""
    server_nodes: int = 1
    """Nodes that run generation servers."""
    gpus_per_node: int = 8
    """GPUs on every node; 0: CPU nodes (no GPU request, one training rank per node, servers
    must be areal-flow)."""
    servers_per_node: int = 1
    """Servers per server node; on GPU nodes each gets gpus_per_node / servers_per_node GPUs as its
    tensor-parallel size."""
    server_program: Literal["sglang", "areal-flow"] = "sglang"
    """What the servers run: SGLang (GPU nodes), or `areal-flow serve` (our SGLang-protocol server
    over the local engine: CPU nodes and tests; on GPU nodes it uses its GPUs without tensor
    parallelism)."""
    recipe: str = "recipes/gsm8k_grpo.py"
    """The training script, relative to the folder sbatch is run from (or absolute)."""
    job_name: str = "areal-flow"
    """SLURM job name (also names the log file, <job_name>-<job id>.out)."""
    time: str = "24:00:00"
    """SLURM time limit."""
    partition: str | None = None
    """SLURM partition; the cluster's default when not given."""
    port_base: int = 30000
    """Port of the first server on a node; the next ones count up from it."""
    rendezvous_port: int = RENDEZVOUS_PORT
    """Port of torchrun's rendezvous on the first training node."""
    recipe_args: Annotated[tuple[str, ...], tyro.conf.Positional,
                           tyro.conf.arg(metavar="[-- RECIPE_ARG ...]")] = ()
    """More arguments for the recipe, after `--`: -- --steps 200 --rollout.batch-size 64."""

    @property
    def tp_size(self) -> int:
        """GPUs per server (0 on CPU nodes)."""
        return self.gpus_per_node // self.servers_per_node

    @property
    def ranks_per_node(self) -> int:
        """Training ranks per training node: one per GPU, one on a CPU node."""
        return self.gpus_per_node or 1


@attrs.frozen(kw_only=True)
class SlurmLayout:
    """An allocation in the SLURM generator's numbers: server nodes first, then training nodes."""

    server_nodes: int
    training_nodes: int
    servers_per_node: int
    gpus_per_node: int
    """0 on CPU nodes."""
    tp: int
    ranks_per_node: int

    def job_fields(self) -> dict[str, Any]:
        """`SlurmJob(model=..., **fields)` in SlurmJob's names: its `nodes` are the training
        nodes, its tp is gpus_per_node // servers_per_node, CPU nodes run areal-flow serve."""
        fields: dict[str, Any] = {"nodes": self.training_nodes, "server_nodes": self.server_nodes,
                                  "gpus_per_node": self.gpus_per_node,
                                  "servers_per_node": self.servers_per_node}
        if not self.gpus_per_node:
            fields["server_program"] = "areal-flow"
        return fields


def slurm_layout(allocation: Allocation) -> SlurmLayout:
    """The numbers for `SlurmJob`, which runs the same servers on every server
    node (tp = gpus // servers a node) and one rank per GPU (one per CPU node) on every
    training node: an allocation that would leave part of a node idle is refused, quoting the
    part and suggesting one that fills its nodes."""
    a = allocation
    if a.nodes == 1:
        raise AllocationError(
            f"'on {a.where_part()}': a SLURM job runs the servers and the training on separate "
            f"nodes: say how many, e.g. '{repair(a, whole=True)}'")
    if a.servers != a.server_nodes * a.servers_per_node or \
            (not a.cpu and a.servers_per_node * a.tp != a.gpus_per_node):
        raise AllocationError(
            f"'{a.generation_part()}': a SLURM job starts the same number of servers on each "
            f"server node{'' if a.cpu else ', using all of its GPUs'}: try "
            f"'{repair(a, whole=True)}'")
    if not a.cpu and a.ranks_per_node != a.gpus_per_node:
        raise AllocationError(
            f"'{a.training_part()}': a SLURM job runs one rank per GPU on each training node, "
            f"{a.gpus_per_node} a node: try '{repair(a, whole=True)}'")
    return SlurmLayout(server_nodes=a.server_nodes, training_nodes=a.training_nodes,
                       servers_per_node=a.servers_per_node, gpus_per_node=a.gpus_per_node,
                       tp=a.tp, ranks_per_node=a.ranks_per_node)


def check(job: SlurmJob) -> None:
    """Raise ValueError naming the first field with a value the script cannot use."""
    for field in ("nodes", "server_nodes", "servers_per_node"):
        if getattr(job, field) < 1:
            raise ValueError(f"'{field}' must be >= 1: {getattr(job, field)}")
    if job.gpus_per_node < 0:
        raise ValueError(f"'gpus_per_node' must be >= 0 (0: CPU nodes): {job.gpus_per_node}")
    if job.server_program not in ("sglang", "areal-flow"):
        raise ValueError(f"'server_program' must be sglang or areal-flow: {job.server_program!r}")
    if job.gpus_per_node == 0 and job.server_program == "sglang":
        raise ValueError("'gpus_per_node' 0 (CPU nodes) needs --server-program areal-flow: "
                         "SGLang runs on GPUs")
    if job.gpus_per_node and job.gpus_per_node % job.servers_per_node:
        raise ValueError(f"'servers_per_node' must divide gpus_per_node={job.gpus_per_node} "
                         f"(each server gets the same number of GPUs): {job.servers_per_node}")
    if not 1024 <= job.port_base <= 65535 - job.servers_per_node:
        raise ValueError(f"'port_base' must be in 1024..{65535 - job.servers_per_node}: "
                         f"{job.port_base}")
    if not 1024 <= job.rendezvous_port <= 65535:
        raise ValueError(f"'rendezvous_port' must be in 1024..65535: {job.rendezvous_port}")
    # #SBATCH lines are split on whitespace
    for field in ("job_name", "time", "partition"):
        value = getattr(job, field)
        if value is not None and not re.fullmatch(r"[\w.:+-]+", value):
            raise ValueError(f"'{field}' must be non-empty letters, digits or ._:+-: {value!r}")
    if not job.model:
        raise ValueError("'model' must name a model folder or hub id")


def server_commands(job: SlurmJob) -> list[tuple[int, str, list[str]]]:
    """(port, CUDA_VISIBLE_DEVICES, command) of each server on a server node ("" for the
    devices on CPU nodes: none visible)."""
    from areal_flow.inference.launcher import (SGLangLauncher, ServerSlot, serve_command,
                                               sglang_command)

    ports = tuple(job.port_base + i for i in range(job.servers_per_node))
    tp = job.tp_size or 1  # CPU nodes: one "slot" per server, no GPUs in it
    launcher = SGLangLauncher(job.model, gpus=tuple(range(tp * job.servers_per_node)),
                              tp_size=tp, host="0.0.0.0", ports=ports)
    servers = []
    for index, port in enumerate(ports):
        gpus = tuple(range(index * job.tp_size, (index + 1) * job.tp_size))
        slot = ServerSlot(index=index, host="0.0.0.0", port=port, gpus=gpus)
        # this machine's interpreter path means nothing on the nodes: use the job's PATH
        if job.server_program == "sglang":
            argv = ["python", *sglang_command(launcher, slot)[1:]]
        else:  # [python, -m, areal_flow.cli, serve, ...] -> areal-flow serve ...
            argv = ["areal-flow", *serve_command(
                launcher, slot, device=None if job.gpus_per_node else "cpu")[3:]]
        servers.append((port, ",".join(map(str, gpus)), argv))
    return servers


def sbatch_script(job: SlurmJob) -> str:
    """The sbatch script for `job` (see the module docstring); ValueError names a bad field."""
    from areal_flow.inference.launcher import FORBIDDEN_ENV

    check(job)
    q = shlex.quote
    partition = f"#SBATCH --partition={job.partition}\n" if job.partition else ""
    gpus = f"#SBATCH --gpus-per-node={job.gpus_per_node}\n" if job.gpus_per_node else ""
    starts = "".join(f"  start_server \"$node\" {port} {q(devices)} {shlex.join(argv)}\n"
                     for port, devices, argv in server_commands(job))
    train = shlex.join(["--model", job.model, "--inference.backend", "sglang"])
    extra = f" \\\n    {shlex.join(job.recipe_args)}" if job.recipe_args else ""
    program = "SGLang" if job.server_program == "sglang" else "areal-flow serve"
    if job.gpus_per_node:
        layout = f"{job.tp_size} GPU(s) per server; {job.nodes} node(s) train, " \
                 f"{job.gpus_per_node} rank(s) each"
        status = "UNTESTED on real SLURM clusters with GPUs: read it before submitting."
    else:
        layout = f"CPU nodes; {job.nodes} node(s) train, one rank each"
        status = "CPU nodes with areal-flow serve: tested under a real SLURM (one machine)."
    return f"""#!/bin/bash
# Generated by `areal-flow slurm`. {status}
# {job.server_nodes} node(s) run {job.servers_per_node} {program} server(s) each ({layout}).
# The job inherits the environment sbatch runs in (activate the venv first); the folder sbatch
# runs from must be on a filesystem every node sees (addresses file, weights, run folder).
#SBATCH --job-name={job.job_name}
#SBATCH --nodes={job.nodes + job.server_nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time={job.time}
#SBATCH --output=%x-%j.out
{partition}
set -euo pipefail
cd "$SLURM_SUBMIT_DIR"

SERVER_NODES={job.server_nodes}
TRAIN_NODES={job.nodes}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${{#NODES[@]}}" -ne $((SERVER_NODES + TRAIN_NODES)) ]; then
  echo "expected $((SERVER_NODES + TRAIN_NODES)) nodes, SLURM gave ${{#NODES[@]}}" >&2
  exit 1
fi
SERVER_HOSTS=("${{NODES[@]:0:SERVER_NODES}}")
TRAIN_HOSTS=("${{NODES[@]:SERVER_NODES}}")
HEAD=${{TRAIN_HOSTS[0]}}

JOB_DIR="$SLURM_SUBMIT_DIR/slurm-$SLURM_JOB_ID"
ADDRESSES="$JOB_DIR/addresses.txt"
mkdir -p "$JOB_DIR/logs"
echo "# generation servers (host:port) that answer /health; the training re-reads this file" \\
  > "$ADDRESSES"
echo "server nodes: ${{SERVER_HOSTS[*]}}; training nodes: ${{TRAIN_HOSTS[*]}}; logs: $JOB_DIR/logs"

# SLURM would end the servers with the job; this ends them as soon as training exits
# (srun passes SIGTERM on to its task)
trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT

SERVER_PIDS=()
# start_server NODE PORT GPUS COMMAND...: run COMMAND on NODE in the background and append
# NODE:PORT to the addresses file once it answers /health.
start_server() {{
  local node=$1 port=$2 gpus=$3
  shift 3
  srun --nodes=1 --ntasks=1 -w "$node" --overlap \\
    env -u {FORBIDDEN_ENV} CUDA_VISIBLE_DEVICES="$gpus" "$@" \\
    > "$JOB_DIR/logs/server-$node-$port.log" 2>&1 &
  local pid=$!
  SERVER_PIDS+=("$pid")
  (
    # the server is another process on another node: polling is the only readiness signal
    while kill -0 "$pid" 2>/dev/null; do
      if curl -sf -o /dev/null "http://$node:$port/health"; then
        echo "$node:$port" >> "$ADDRESSES"
        exit 0
      fi
      sleep {HEALTH_POLL_SECONDS}
    done
    echo "server $node:$port exited before answering /health: see $JOB_DIR/logs" >&2
  ) &
}}

any_server_running() {{
  local pid
  for pid in "${{SERVER_PIDS[@]}}"; do
    kill -0 "$pid" 2>/dev/null && return 0
  done
  return 1
}}

for node in "${{SERVER_HOSTS[@]}}"; do
{starts}done

# the pool needs one answering server to start; the others join when they answer
until grep -qv '^#' "$ADDRESSES"; do
  if ! any_server_running; then
    echo "every server exited before answering /health: see $JOB_DIR/logs" >&2
    exit 1
  fi
  sleep {HEALTH_POLL_SECONDS}
done

# one torchrun per training node (--ntasks: else srun takes the job's SLURM_NTASKS, which counts
# the server nodes too, and starts two torchruns on one node)
srun --nodes="$TRAIN_NODES" --ntasks="$TRAIN_NODES" --ntasks-per-node=1 \\
  -w "$(IFS=,; echo "${{TRAIN_HOSTS[*]}}")" \\
  torchrun --nnodes "$TRAIN_NODES" --nproc-per-node {job.ranks_per_node} \\
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:{job.rendezvous_port}" --rdzv-id "$SLURM_JOB_ID" \\
    {q(job.recipe)} {train} \\
    --inference.addresses-file "$ADDRESSES"{extra}
"""


def command(job: Annotated[SlurmJob, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name="")],
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
    from areal_flow.cli import say

    if allocation is not None:
        defaults = attrs.fields_dict(SlurmJob)
        given = [f"--{name.replace('_', '-')}" for name in SLURM_ALLOCATION_FIELDS
                 if getattr(job, name) != defaults[name].default]
        if given:
            say(f"--allocation '{allocation}' already says {', '.join(given)}: give one or "
                "the other", error=True)
            return 2
        try:
            job = attrs.evolve(job, **slurm_layout(allocation).job_fields())
        except AllocationError as exc:
            say(f"--allocation: {exc}", error=True)
            return 2
    try:
        script = sbatch_script(job)
    except ValueError as exc:
        say(str(exc), error=True)
        return 2
    if out is None:
        print(script, end="")
        return 0
    Path(out).write_text(script)
    say(f"wrote {out}; submit it with: sbatch {out}")
    return 0


SLURM_ALLOCATION_FIELDS = ("nodes", "server_nodes", "gpus_per_node", "servers_per_node",
                           "server_program")
"""The `areal-flow slurm` options an --allocation sets (given with it, they are refused)."""
