"""Which node and device runs every process of an `Allocation` (`Allocation.placement`).

On one node the training ranks take the first GPUs (torchrun's rank r trains on
``cuda:LOCAL_RANK``) and the servers the next ones, `tp` consecutive GPUs each. On several nodes
no node is shared, as in the SLURM job: the servers fill the first nodes (``gpus // tp`` a node),
the training ranks spread evenly over the rest (torchrun starts the same ``--nproc-per-node`` on
every node); on CPU nodes each training node runs one rank and the servers share the other
nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from areal_flow.launch.allocation import Allocation


@attrs.frozen(kw_only=True)
class ServerPlace:
    """Where generation server `index` runs: `tp` consecutive GPUs of one node (none on CPUs)."""

    index: int
    node: int
    gpus: tuple[int, ...]
    port: int | None


@attrs.frozen(kw_only=True)
class RankPlace:
    """Where training rank `rank` runs; on GPUs, `gpu` is its local rank (cuda:LOCAL_RANK)."""

    rank: int
    node: int
    local_rank: int
    gpu: int | None


@attrs.frozen(kw_only=True)
class Placement:
    """Which node and device runs every process of an `Allocation`."""

    allocation: Allocation
    servers: tuple[ServerPlace, ...]
    ranks: tuple[RankPlace, ...]

    @property
    def idle(self) -> tuple[tuple[int, int], ...]:
        """(node, GPU) pairs that no process uses."""
        used = {(s.node, g) for s in self.servers for g in s.gpus} | \
            {(r.node, r.gpu) for r in self.ranks}
        return tuple((n, g) for n in range(self.allocation.nodes)
                     for g in range(self.allocation.gpus_per_node) if (n, g) not in used)

    def rows(self) -> list[tuple[int, str, str, str]]:
        """(node, device, process, port) of every process and idle GPU, by node then GPU."""
        keyed = [((s.node, s.gpus[0] if s.gpus else -1),
                  (s.node, _devices(s.gpus), f"generation server {s.index}",
                   "free" if s.port is None else str(s.port))) for s in self.servers]
        keyed += [((r.node, -1 if r.gpu is None else r.gpu),
                   (r.node, _devices(() if r.gpu is None else (r.gpu,)),
                    f"training rank {r.rank}", "")) for r in self.ranks]
        keyed += [((n, g), (n, _devices((g,)), "idle", "")) for n, g in self.idle]
        # stable: on CPUs, where every key of a node is equal, servers then ranks by index
        return [row for _, row in sorted(keyed, key=lambda pair: pair[0])]

    def table(self) -> Any:
        """The placement as a rich Table: one row per process and per idle GPU."""
        from rich import box
        from rich.table import Table

        table = Table("node", "device", "process", "port", box=box.SIMPLE_HEAD)
        for node, device, process, port in self.rows():
            table.add_row(str(node), device, process, port)
        return table


def _devices(gpus: Sequence[int]) -> str:
    if not gpus:
        return "cpu"
    return f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {gpus[0]}-{gpus[-1]}"
