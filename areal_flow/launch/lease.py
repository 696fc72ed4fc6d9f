"""Leases on generation servers: one training run at a time writes weights into a server.

Servers may outlive runs (`areal-flow serve` or SGLang started by hand), and a second run can
attach to them with ``--inference.addresses``. SGLang has no notion of an owner, so the leases
live on the filesystem the runs already share for weight folders: one file per server address
in a lease folder, saying which run holds it and until when. The SGLang pool takes a server's
lease before it sends the server anything, renews its leases on every refresh, and gives them
back when it closes. A lease whose time has passed, or whose process is gone from this host (its
run died), is free; a lease held by another live run makes the server unusable to this one, with
a message naming the holder.

Each lease is read, checked and written under an exclusive ``flock`` of its own lock file, so
two runs starting together cannot both take a server (the lease folder must be on a filesystem
with working locks: local, or NFSv4).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs


class ServerLeased(RuntimeError):
    """The server's lease is held by another run."""


def default_holder(run: str | os.PathLike | None = None) -> str:
    """This process, as a lease names it: the run folder, host and pid."""
    return f"{run or 'a run'} (pid {os.getpid()} on {socket.gethostname()})"


@attrs.define
class Leases:
    """The leases one run holds, in `directory`; each lasts `ttl` seconds unless renewed."""

    directory: Path = attrs.field(converter=lambda p: Path(p).expanduser())
    holder: str = attrs.field(factory=default_holder)
    ttl: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    held: set[str] = attrs.field(factory=set)
    _token: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    """Tells this run's lease files from another's with the same holder text."""

    def acquire(self, address: str) -> None:
        """Hold `address` (again), or raise `ServerLeased` naming the run that holds it."""
        path = self._path(address)
        with self._locked(path):
            current = self._read(path)
            if current is not None and current["token"] != self._token \
                    and current["expires"] > time.time() and _alive(current):
                left = current["expires"] - time.time()
                raise ServerLeased(
                    f"generation server {address} is leased by {current['holder']} (for "
                    f"{left:.0f} s more unless it renews): two runs must not write weights "
                    "into one server; stop that run, wait for it to finish, or give this run "
                    f"other servers (lease files: {self.directory})")
            self._write(path, address)
        self.held.add(address)

    def renew(self) -> list[str]:
        """Extend every lease held; returns the addresses whose lease another run took over
        meanwhile (this run's lease had expired), which are no longer held."""
        lost = []
        for address in sorted(self.held):
            path = self._path(address)
            with self._locked(path):
                current = self._read(path)
                if current is None or current["token"] != self._token:
                    lost.append(address)
                    self.held.discard(address)
                    continue
                self._write(path, address)
        return lost

    def release(self, address: str | None = None) -> None:
        """Give back `address`'s lease (every lease held when None)."""
        for one in [address] if address is not None else sorted(self.held):
            path = self._path(one)
            with self._locked(path):
                current = self._read(path)
                if current is not None and current["token"] == self._token:
                    path.unlink()
            self.held.discard(one)

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        """Read, decide and write a lease under an exclusive lock of its own lock file."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, path: Path, address: str) -> None:
        tmp = path.with_name(f"{path.name}.{self._token}.tmp")
        tmp.write_text(json.dumps({"address": address, "holder": self.holder,
                                   "token": self._token, "expires": time.time() + self.ttl,
                                   "host": socket.gethostname(), "pid": os.getpid()}))
        os.replace(tmp, path)

    def _path(self, address: str) -> Path:
        return self.directory / (address.replace("://", "_").replace("/", "_")
                                 .replace(":", "_") + ".lease")

    @staticmethod
    def _read(path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None


def _alive(lease: dict) -> bool:
    """Whether the lease's process may still run: on another host it is taken on trust until
    the lease expires; on this one a process that is gone holds nothing."""
    if lease.get("host") != socket.gethostname() or "pid" not in lease:
        return True
    try:
        os.kill(lease["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
