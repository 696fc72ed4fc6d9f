"""One live run per run folder: a lock that the run holds for its life.

Two runs writing into one folder (a second start, or a `--resume` while the first still runs)
would interleave their metrics and overwrite each other's checkpoints. The run holds an
exclusive ``flock`` on ``<run folder>/run.lock`` from start to close. The kernel drops it when
the holding process dies, however it dies, so a dead run's lock is never in the way: no expiry
to wait out. The file's text names the holder (host, pid, start time) for the refusal.
It must be on a filesystem with working locks (local, or NFSv4), as the server leases are.
The file stays after the run: deleting it on release would let a process that opened the old
file lock it while a newer one locks a new file of the same name.
"""

from __future__ import annotations

import fcntl
import os
import socket
from datetime import datetime
from pathlib import Path


class RunFolderInUse(RuntimeError):
    """Another live process holds the run folder."""


class RunLock:
    """Held from construction until `release` (or the process's end)."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / "run.lock"
        handle = open(self.path, "a+")  # noqa: SIM115 — held open for the run's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RunFolderInUse(
                f"{folder} is in use by a live run: {holder}. Two runs in one folder would "
                "overwrite each other's checkpoints and metrics: wait for it to end (or stop "
                "it), or choose another --run-dir") from None
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
                     f"{datetime.now():%Y-%m-%d %H:%M:%S}\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor drops the flock
            self._handle = None
