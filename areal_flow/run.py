"""A training run's folder and what its user sees.

The folder holds the resolved `config.yaml`, `metrics.jsonl` (one line per step, every
component's `stats()`), `samples.jsonl` (a few prompt/completion/reward triples per step),
`checkpoints/step-N/` (exact-resume state plus a `save_pretrained` model) and the servers' logs.
Recipes print through `LiveDisplay` and stop cleanly through `StopRequest`.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from areal_flow.config import dump

COMPLETE = "COMPLETE"
"""Marker written into a checkpoint folder once everything in it is on disk."""


class RunDir:
    """The run folder. A new run refuses a folder that already holds one (unless resuming);
    resuming drops metric and sample lines after the checkpoint's step, so curves do not fork."""

    def __init__(self, path: str | Path, *, resume: bool = False):
        self.path = Path(path)
        self.resume = resume
        if resume and not self.path.is_dir():
            raise FileNotFoundError(f"--resume: no run folder at {self.path}")
        if not resume and (self.path / "metrics.jsonl").exists():
            raise FileExistsError(f"{self.path} already holds a run: pass --resume to continue it "
                                  "or choose another --run-dir")
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"

    @staticmethod
    def default_path(recipe: str) -> Path:
        return Path("runs") / f"{recipe}-{datetime.now():%Y%m%d-%H%M%S}"

    def write_config(self, config: Any) -> None:
        dump(config, self.path / "config.yaml")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._append("metrics.jsonl", [{"step": step, **metrics}])

    def log_samples(self, step: int, samples: Iterable[dict[str, Any]]) -> None:
        self._append("samples.jsonl", [{"step": step, **s} for s in samples])

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint: (step, folder)."""
        done = sorted(p for p in self.checkpoints.glob("step-*") if (p / COMPLETE).exists())
        return (int(done[-1].name.split("-")[1]), done[-1]) if done else None

    def truncate_after(self, step: int) -> None:
        """Forget logged lines of steps after `step` (they are about to be redone)."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            file = self.path / name
            if file.exists():
                kept = [line for line in file.read_text().splitlines()
                        if line and json.loads(line)["step"] <= step]
                file.write_text("".join(f"{line}\n" for line in kept))

    def _append(self, name: str, records: list[dict[str, Any]]) -> None:
        with open(self.path / name, "a") as f:
            for record in records:
                f.write(json.dumps(record, default=float) + "\n")


class StopRequest:
    """The first Ctrl-C or SIGTERM asks the run to stop after the current step (it then writes a
    checkpoint and stops launched servers); a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
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
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: stopping after this step and writing a "
              "checkpoint (Ctrl-C again to stop at once)", flush=True)


class LiveDisplay:
    """A rich live panel on a terminal (step, chosen metrics, ETA, one sample); one log line per
    step elsewhere (CI logs, files). `columns` maps metric keys to labels."""

    def __init__(self, total_steps: int, start_step: int, columns: dict[str, str],
                 enabled: bool = True):
        from rich.console import Console

        self.console = Console()
        self.total, self.start = total_steps, start_step
        self.columns = columns
        self.enabled = enabled
        self.began = time.monotonic()
        self._live = None

    def __enter__(self) -> LiveDisplay:
        if self.enabled and self.console.is_terminal:
            from rich.live import Live

            self._live = Live(console=self.console, refresh_per_second=2)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def print(self, *args: Any) -> None:
        if self.enabled:
            self.console.print(*args)

    def update(self, step: int, metrics: dict[str, float], sample: str | None = None) -> None:
        """Show the state after `step` (1-based count of finished steps)."""
        if not self.enabled:
            return
        done = step - self.start
        elapsed = time.monotonic() - self.began
        eta = elapsed / max(done, 1) * (self.total - step)
        values = {label: metrics.get(key) for key, label in self.columns.items()}
        if self._live is None:
            shown = " ".join(f"{label} {_fmt(v)}" for label, v in values.items() if v is not None)
            self.console.print(f"step {step}/{self.total} {shown} eta {eta / 60:.1f} min",
                               highlight=False)
            return
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        table = Table(box=None, show_header=True, header_style="bold")
        for label in ["step", *values, "elapsed", "ETA"]:
            table.add_column(label, justify="right")
        table.add_row(f"{step}/{self.total}", *(_fmt(v) for v in values.values()),
                      f"{elapsed / 60:.1f} min", f"{eta / 60:.1f} min")
        parts = [table]
        if sample:
            parts.append(Panel(sample[-600:], title="a sample completion", title_align="left"))
        self._live.update(Group(*parts))


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
