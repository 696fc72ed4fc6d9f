"""One live run per run folder: a ``flock`` on ``<folder>/run.lock``, dropped however the holder
dies (needs local or NFSv4 locks); never deleted, lest two processes lock different files."""

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
        self._handle.close()  # closing the descriptor drops the flock; again: nothing
