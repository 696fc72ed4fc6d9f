"""How a run is asked to stop: Ctrl-C or SIGTERM, once to stop cleanly, twice to stop now."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any


class StopRequest:
    """The first Ctrl-C or SIGTERM stops the run after this step (at once if waiting for a batch);
    another raises KeyboardInterrupt, unless within `repeat_window` (a SLURM or torchrun relay)."""

    def __init__(self, repeat_window: float = 1.0) -> None:
        self.requested = False
        self.repeat_window = repeat_window
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            if time.monotonic() - self._first < self.repeat_window:
                return  # the same stop, relayed by a launcher
            raise KeyboardInterrupt  # asked again: now
        self.requested, self._first = True, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: stopping after this step (or now, when waiting "
              "for a batch) and writing a checkpoint; again to stop at once", flush=True)
