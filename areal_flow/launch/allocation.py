"""Where everything runs, as one readable value: ``--allocation``.

    generation: 2 servers x tp 2, training: 4 ranks                  one node, 8 GPUs
    generation: 2 servers x tp 2, training: 4 ranks on 8 gpus        the same, said in full
    generation: 4 servers x tp 2, training: 16 ranks on 3 nodes x 8 gpus
    generation: 2 servers, training: 1 rank on cpu                   `areal-flow serve` servers
    generation: 2 servers, training: 1 rank on 2 cpu nodes

Grammar (case and spacing are free, ``x`` may be ``×``, nouns singular or plural)::

    allocation := part "," part [ "on" where ]        the two parts in either order
    part       := "generation:" S "servers" [ "x tp" T ]  |  "training:" R "ranks"
    where      := G "gpus"  |  N "nodes x" G "gpus"  |  "cpu"  |  N "cpu nodes"

Without ``on`` it is one node with exactly the GPUs named. `Allocation.parse` reads it,
``str(allocation)`` writes it back in canonical form (``parse(str(a)) == a``); every error quotes
the part that is wrong and ends with an allocation that would be accepted.

Where each process of an allocation runs is `placement.py`'s (`Allocation.placement`).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from areal_flow.launch.placement import Placement, RankPlace, ServerPlace

EXAMPLES = ("generation: 2 servers x tp 2, training: 4 ranks",
            "generation: 4 servers x tp 2, training: 16 ranks on 3 nodes x 8 gpus",
            "generation: 2 servers, training: 1 rank on cpu")
"""Accepted allocations, shown by errors that have no repair of the user's own to suggest."""

_X = r"\s*[x×*]\s*"
_GENERATION = re.compile(rf"(\d+)\s*servers?(?:{_X}tp\s*(\d+))?", re.I)
_TRAINING = re.compile(r"(\d+)\s*ranks?", re.I)
_GPUS = re.compile(r"(\d+)\s*gpus?", re.I)
_GPU_NODES = re.compile(rf"(\d+)\s*nodes?{_X}(\d+)\s*gpus?", re.I)
_CPU = re.compile(r"cpus?", re.I)
_CPU_NODES = re.compile(r"(\d+)\s*cpu\s*nodes?", re.I)


class AllocationError(ValueError):
    """An allocation that cannot be read or cannot run; the message quotes the wrong part."""


@attrs.frozen(kw_only=True)
class Allocation:
    """Where generation servers and training ranks run (see the module docstring)."""

    servers: int
    """Generation servers: SGLang on GPUs, `areal-flow serve` on CPUs."""
    tp: int = 1
    """Tensor-parallel GPUs per server, all on one node (1 on CPUs)."""
    ranks: int
    """Training ranks: torchrun's world size."""
    nodes: int = 1
    """Machines, all alike."""
    gpus_per_node: int | None = None
    """GPUs of each node; None: one node with exactly the GPUs its processes use (0 on CPUs)."""
    device: Literal["gpu", "cpu"] = attrs.field(default="gpu",
                                                validator=attrs.validators.in_(("gpu", "cpu")))
    """gpu: every server and rank has GPUs of its own; cpu: they share their nodes' CPUs."""

    def __attrs_post_init__(self) -> None:
        if self.gpus_per_node is None:  # resolved here, so equal allocations compare equal
            # (counts below 1 are refused below; counted as 1 here so that the suggested
            # repair of one stays on one node)
            used = max(self.ranks, 1) + max(self.servers, 1) * max(self.tp, 1)
            object.__setattr__(self, "gpus_per_node", 0 if self.cpu else used)
        _check(self)

    # -- reading and writing -------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> Allocation:
        """Read an allocation (the grammar is in the module docstring)."""
        if not text.strip():
            raise AllocationError(f"--allocation is empty: e.g. '{EXAMPLES[0]}'")
        head, *where = re.split(r"\s+on\b", text.strip(), maxsplit=1, flags=re.I)
        parts = _parts(head)
        servers = _fullmatch(_GENERATION, "generation", parts["generation"],
                             "generation: S servers [x tp T]")
        ranks = _fullmatch(_TRAINING, "training", parts["training"], "training: R ranks")
        fields = {"servers": int(servers[1]), "tp": int(servers[2] or 1), "ranks": int(ranks[1])}
        return cls(**fields, **(_where(where[0].strip()) if where else {}))

    def __str__(self) -> str:
        return f"{self.generation_part()}, {self.training_part()} on {self.where_part()}"

    def generation_part(self) -> str:
        return f"generation: {_plural(self.servers, 'server')}" + \
            (f" x tp {self.tp}" if self.tp != 1 else "")

    def training_part(self) -> str:
        return f"training: {_plural(self.ranks, 'rank')}"

    def where_part(self) -> str:
        if self.cpu:
            return "cpu" if self.nodes == 1 else f"{self.nodes} cpu nodes"
        gpus = _plural(self.gpus_per_node, "gpu")
        return gpus if self.nodes == 1 else f"{_plural(self.nodes, 'node')} x {gpus}"

    # -- derived numbers -----------------------------------------------------------------------

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def server_nodes(self) -> int:
        """Nodes running servers (on one node: that node)."""
        if self.nodes == 1:
            return 1
        return self.nodes - self.ranks if self.cpu else \
            math.ceil(self.servers / self.servers_per_node)

    @property
    def servers_per_node(self) -> int:
        """Most servers on one node; the last server node may hold fewer."""
        if self.nodes == 1:
            return self.servers
        return math.ceil(self.servers / self.server_nodes) if self.cpu else \
            self.gpus_per_node // self.tp

    @property
    def training_nodes(self) -> int:
        if self.nodes == 1:
            return 1
        return self.nodes - self.server_nodes

    @property
    def ranks_per_node(self) -> int:
        """torchrun's --nproc-per-node."""
        return self.ranks // self.training_nodes

    def summary(self) -> str:
        """One line: how many of what, where."""
        servers = _plural(self.servers, "server") + (f" x tp {self.tp}" if not self.cpu else "")
        ranks = _plural(self.ranks, "training rank")
        if self.nodes == 1:
            used = "this machine's CPUs" if self.cpu else \
                f"{self.ranks + self.servers * self.tp} of {self.gpus_per_node} GPUs"
            return f"{servers} and {ranks} on {used}"
        return (f"{servers} on {_plural(self.server_nodes, 'node')}, {ranks} on "
                f"{_plural(self.training_nodes, 'node')} ({self.ranks_per_node} a node)")

    # -- where each process runs ---------------------------------------------------------------

    def placement(self, port_base: int | None = None) -> Placement:
        """Every server's and rank's node and GPUs (module docstring). A server's port is
        `port_base` + its index on its node; None: a free port picked at launch, as the local
        launcher does."""
        servers = []
        for i in range(self.servers):
            node, slot = divmod(i, self.servers_per_node)
            first = (self.ranks if self.nodes == 1 else 0) + slot * self.tp
            servers.append(ServerPlace(
                index=i, node=node, gpus=() if self.cpu else tuple(range(first, first + self.tp)),
                port=None if port_base is None else port_base + slot))
        ranks = []
        for r in range(self.ranks):
            node, local = divmod(r, self.ranks_per_node)
            ranks.append(RankPlace(rank=r, node=node + (self.server_nodes if self.nodes > 1 else 0),
                                   local_rank=local, gpu=None if self.cpu else local))
        return Placement(allocation=self, servers=tuple(servers), ranks=tuple(ranks))

    # -- what it sets, and checks against where it was started ---------------------------------

    def inference_fields(self) -> dict[str, Any]:
        """The `InferenceConfig` fields it sets, from which the launcher starts the servers: the
        GPUs of node 0's servers (on several nodes the servers are started elsewhere, on these
        GPUs of each server node)."""
        node_0 = [s for s in self.placement().servers if s.node == 0]
        if self.cpu:
            return {"backend": "sglang", "server_program": "areal-flow", "device": "cpu",
                    "server_gpus": tuple(range(len(node_0))), "tp_size": 1}
        return {"backend": "sglang", "server_gpus": tuple(g for s in node_0 for g in s.gpus),
                "tp_size": self.tp}

    def owned_flags(self) -> list[str]:
        """The --inference.* options it replaces."""
        return [f"--inference.{name.replace('_', '-')}" for name in self.inference_fields()]

    def apply(self, inference: Any, *, default: Any) -> Any:
        """`inference` with `inference_fields`. A field that is neither `default`'s value nor
        the allocation's was set otherwise: refused, naming both."""
        owned = self.inference_fields()
        for name, value in owned.items():
            given = getattr(inference, name)
            if given != getattr(default, name) and given != value:
                shown = " ".join(map(str, given)) if isinstance(given, tuple) else given
                raise AllocationError(
                    replaced_flags_message(self, [f"--inference.{name.replace('_', '-')} {shown}"]))
        return attrs.evolve(inference, **owned)

    def check_launch(self, *, world_size: int, local_world_size: int, visible_gpus: int,
                     has_addresses: bool, command: Sequence[str]) -> None:
        """This process was started as the allocation says: torchrun's world is `ranks`,
        `ranks_per_node` of them here; this node has the GPUs (or none, on cpu); servers on
        other nodes come as addresses. AllocationError shows `launch_command`."""
        start = launch_command(self, command)
        if world_size != self.ranks or local_world_size != self.ranks_per_node:
            raise AllocationError(
                f"'{self.training_part()}' ({self.ranks_per_node} on this node) but this runs "
                f"{_plural(world_size, 'training process')}, {local_world_size} on this node "
                f"(torchrun's WORLD_SIZE, LOCAL_WORLD_SIZE): start it with\n  {start}")
        if not self.cpu and visible_gpus < self.gpus_per_node:
            raise AllocationError(
                f"'on {self.where_part()}' but this node has {_plural(visible_gpus, 'visible GPU')} "
                f"(CUDA_VISIBLE_DEVICES): say 'on {_plural(visible_gpus, 'gpu')}' if its "
                "processes fit, or run it on a larger node")
        if self.cpu and visible_gpus:
            raise AllocationError(
                f"'on {self.where_part()}' but {_plural(visible_gpus, 'GPU')} is visible, where "
                "training would run: hide them (CUDA_VISIBLE_DEVICES=) or say 'on G gpus'")
        if self.nodes > 1 and not has_addresses:
            raise AllocationError(
                f"'on {self.where_part()}': the servers run on other nodes, which this process "
                "cannot start: start them (`areal-flow slurm` writes a job that does) and pass "
                f"--inference.addresses-file FILE, then on each training node:\n  {start}")


def launch_command(allocation: Allocation, command: Sequence[str]) -> str:
    """How to start `command` (a recipe and its arguments) as `allocation` says: python for
    one rank, torchrun for several, torchrun on each training node for several nodes (with the
    addresses of servers started on the others)."""
    a, args = allocation, shlex.join(command)
    if a.nodes > 1:
        if not any(arg.startswith("--inference.addresses") for arg in command):
            args += " --inference.addresses-file FILE"  # the servers, started elsewhere
        return (f"torchrun --nnodes {a.training_nodes} --nproc-per-node {a.ranks_per_node} "
                f"--rdzv-backend c10d --rdzv-endpoint FIRST_TRAINING_NODE:29500 {args}")
    return f"python {args}" if a.ranks == 1 else f"torchrun --nproc-per-node {a.ranks} {args}"


def replaced_flags_message(allocation: Allocation, given: Sequence[str]) -> str:
    """The error for --inference options given together with an --allocation that sets them."""
    return (f"{', '.join(given)}: --allocation '{allocation}' already says where generation "
            f"runs, and sets {', '.join(allocation.owned_flags())} from it: drop "
            f"{' and '.join(flag.split()[0] for flag in given)}, or change the allocation "
            "(--dry-run shows where each process runs)")


def refuse_replaced_flags(args: Sequence[str]) -> None:
    """A command line with --allocation and an --inference option it sets fails: checked on
    the words given, so that a value equal to the default is refused too."""
    text = _option(args, "--allocation")
    if text is None:
        return
    try:
        allocation = Allocation.parse(text)
    except AllocationError:
        return  # the parser reports it, with the option's help
    owned = allocation.owned_flags()
    given = [arg.split("=", 1)[0].replace("_", "-") for arg in args if arg.startswith("--")]
    if replaced := [flag for flag in given if flag in owned]:
        raise AllocationError(replaced_flags_message(allocation, replaced))


def cli_arg() -> Any:
    """tyro's reader of --allocation, for `Annotated[Allocation | None, cli_arg()]` (tyro is
    imported here, not by every module that reads allocations)."""
    import tyro

    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar="'generation: S servers [x tp T], training: R ranks [on ...]'",
        instance_from_str=lambda args: Allocation.parse(args[0]),
        is_instance=lambda value: isinstance(value, Allocation),
        str_from_instance=lambda allocation: [str(allocation)])


# -- parsing ---------------------------------------------------------------------------------


def _parts(head: str) -> dict[str, str]:
    """{'generation': body, 'training': body} of 'label: body, label: body'."""
    parts: dict[str, str] = {}
    for part in head.split(","):
        label, colon, body = part.partition(":")
        label = label.strip().lower()
        if not colon or label not in ("generation", "training"):
            raise AllocationError(
                f"'{part.strip()}': each part is 'generation: S servers [x tp T]' or "
                f"'training: R ranks', the two separated by a comma: e.g. '{EXAMPLES[0]}'")
        if label in parts:
            raise AllocationError(f"'{part.strip()}': a second '{label}:' part (each comes "
                                  f"once): e.g. '{EXAMPLES[0]}'")
        parts[label] = body.strip()
    for label, form in (("generation", "S servers [x tp T]"), ("training", "R ranks")):
        if label not in parts:
            raise AllocationError(f"'{head.strip()}': no '{label}: {form}' part: e.g. "
                                  f"'{EXAMPLES[0]}'")
    return parts


def _fullmatch(pattern: re.Pattern, label: str, body: str, form: str) -> re.Match:
    if match := pattern.fullmatch(body):
        return match
    raise AllocationError(f"'{label}: {body}': expected '{form}' (whole numbers): e.g. "
                          f"'{EXAMPLES[0]}'")


def _where(where: str) -> dict[str, Any]:
    if _CPU.fullmatch(where):
        return {"device": "cpu"}
    if match := _CPU_NODES.fullmatch(where):
        return {"device": "cpu", "nodes": int(match[1])}
    if match := _GPUS.fullmatch(where):
        return {"gpus_per_node": int(match[1])}
    if match := _GPU_NODES.fullmatch(where):
        return {"nodes": int(match[1]), "gpus_per_node": int(match[2])}
    raise AllocationError(f"'on {where}': expected 'on G gpus', 'on N nodes x G gpus', 'on cpu' "
                          f"or 'on N cpu nodes': e.g. '{EXAMPLES[1]}'")


def _option(args: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag` (`--flag value` or `--flag=value`) of a command line."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# -- validation ------------------------------------------------------------------------------


def _check(a: Allocation) -> None:
    """Raise AllocationError quoting the part of `a` that cannot run, with a repaired example."""
    generation, training, where = f"{a.generation_part()}", a.training_part(), f"on {a.where_part()}"
    for part, name, value in ((generation, "servers", a.servers), (generation, "tp", a.tp),
                              (training, "ranks", a.ranks), (where, "nodes", a.nodes)):
        if value < 1:
            raise AllocationError(f"'{part}': {name} must be at least 1: try '{repair(a)}'")
    if a.cpu:
        if a.tp > 1:
            raise AllocationError(f"'{generation}' {where}: an `areal-flow serve` server is one "
                                  f"process, without tensor parallelism: try '{repair(a)}'")
        if a.gpus_per_node:
            raise AllocationError(f"'{where}' has no GPUs, got gpus_per_node="
                                  f"{a.gpus_per_node}: try '{repair(a)}'")
        if a.nodes > 1 and not 1 <= a.server_nodes <= a.servers:
            raise AllocationError(
                f"'{where}': a CPU node that trains runs one rank, so '{training}' takes "
                f"{_plural(a.ranks, 'node')} and leaves {a.nodes - a.ranks} for '{generation}', "
                f"which fills 1 to {a.servers} (at least one server a node): try '{repair(a)}'")
        return
    if a.gpus_per_node < 1:
        raise AllocationError(f"'{where}': a node needs at least 1 GPU: try '{repair(a)}'")
    if a.tp > a.gpus_per_node:
        raise AllocationError(f"'{generation}': a server's {a.tp} GPUs must be on one node, and "
                              f"'{where}' has {a.gpus_per_node} a node: try '{repair(a)}'")
    if a.nodes == 1:
        need = a.ranks + a.servers * a.tp
        if need > a.gpus_per_node:
            raise AllocationError(
                f"'{generation}' ({a.servers * a.tp} GPUs) and '{training}' ({a.ranks}) need "
                f"{need} GPUs, '{where}' has {a.gpus_per_node}: try '{repair(a)}'")
        return
    if a.gpus_per_node % a.tp:
        raise AllocationError(
            f"'{generation}': tp {a.tp} must divide the {a.gpus_per_node} GPUs of a node (on "
            f"several nodes the servers fill whole nodes, gpus // tp each): try '{repair(a)}'")
    if a.training_nodes < 1:
        raise AllocationError(
            f"'{where}': '{generation}' takes {_plural(a.server_nodes, 'node')} "
            f"({a.servers_per_node} servers a node), leaving none for '{training}' (on several "
            f"nodes, a node either generates or trains): try '{repair(a)}'")
    if a.ranks % a.training_nodes or a.ranks // a.training_nodes > a.gpus_per_node:
        raise AllocationError(
            f"'{training}': torchrun starts the same number of ranks, at most "
            f"{a.gpus_per_node}, on each of the {_plural(a.training_nodes, 'training node')} "
            f"that '{generation}' leaves of '{where}': try '{repair(a)}'")


def repair(a: Allocation, *, whole: bool = False) -> Allocation:
    """An accepted allocation close to `a`: the user's counts where they can stay (at least 1;
    tp 1 on CPUs), on nodes of the user's size, as few as hold them. `whole`: every node full,
    as a SLURM job fills them (more servers and ranks where needed)."""
    servers, tp, ranks = max(a.servers, 1), max(a.tp, 1), max(a.ranks, 1)
    if a.cpu:
        if a.nodes <= 1 and not whole:
            return Allocation(servers=servers, ranks=ranks, device="cpu")
        server_nodes = max(1, min(servers, a.nodes - ranks))
        if whole:
            servers = math.ceil(servers / server_nodes) * server_nodes
        return Allocation(servers=servers, ranks=ranks, nodes=ranks + server_nodes, device="cpu")
    gpus = max(a.gpus_per_node, 1)
    if not whole and a.nodes <= 1:
        if tp > gpus:  # one node with exactly the GPUs named
            return Allocation(servers=servers, tp=tp, ranks=ranks)
        if ranks + servers * tp <= gpus:
            return Allocation(servers=servers, tp=tp, ranks=ranks, gpus_per_node=gpus)
    tp = max(d for d in range(1, min(tp, gpus) + 1) if gpus % d == 0)
    per_node = gpus // tp
    if whole:
        servers, ranks = math.ceil(servers / per_node) * per_node, math.ceil(ranks / gpus) * gpus
        return Allocation(servers=servers, tp=tp, ranks=ranks, gpus_per_node=gpus,
                          nodes=servers // per_node + ranks // gpus)
    training_nodes = min(d for d in range(1, ranks + 1) if ranks % d == 0 and ranks // d <= gpus)
    return Allocation(servers=servers, tp=tp, ranks=ranks, gpus_per_node=gpus,
                      nodes=math.ceil(servers / per_node) + training_nodes)
