"""How a run is asked to stop: Ctrl-C or SIGTERM, once to stop cleanly, twice to stop now."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any


class StopRequest:
    """The first Ctrl-C or SIGTERM asks the run to stop after the current step, or at once when
    it is waiting for a batch (it then writes a checkpoint and stops launched servers); a second
    one of either interrupts at once (KeyboardInterrupt). A second signal within
    `repeat_window` seconds of the first is the same request, forwarded: under SLURM every
    process of the job step gets SIGTERM from `scancel`, and torchrun relays its own copy to the
    ranks it started, so a rank gets two within milliseconds."""

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
