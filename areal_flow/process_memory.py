"""Resident memory of processes from Linux's /proc; light, as reward workers import it."""

from __future__ import annotations

import os
import resource
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident bytes of process `pid` now; OSError/ValueError where /proc cannot tell."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (not its child processes')."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def tree_rss_gb() -> float:
    """Resident GB now of this process and all below it (without /proc: this process's peak)."""
    total, todo, seen = 0, [os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            total += rss_bytes(pid)
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):  # gone meanwhile, or no /proc
            if pid == os.getpid():
                return peak_rss_gb()
    return total / 2**30
