"""What a run's user sees: a live panel on a terminal, one line per step elsewhere."""

from __future__ import annotations

import time
from typing import Any


class LiveDisplay:
    """A rich live panel on a terminal, one log line per step elsewhere; a `columns` key ending in
    ``task_metrics`` expands to the batch's "task_metrics" names, its label as their prefix."""

    def __init__(self, total_steps: int, start_step: int, columns: dict[str, str],
                 enabled: bool = True):
        from rich.console import Console

        self.console = Console()
        self.total, self.start = total_steps, start_step
        self.columns = columns
        self.task: list[str] = []
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
            self.console.print(*args, soft_wrap=True)  # paths and commands stay on one line

    def update(self, step: int, metrics: dict[str, float], sample: str | None = None) -> None:
        """Show the state after `step` (1-based count of finished steps)."""
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.began
        eta = elapsed / max(step - self.start, 1) * (self.total - step)
        self.task = metrics.get("task_metrics", self.task)
        values = {}
        for key, label in self.columns.items():
            prefix = key.removesuffix("task_metrics")
            if prefix == key:
                values[label] = metrics.get(key)
            else:
                values.update({label + name: metrics.get(prefix + name) for name in self.task})
        if self._live is None:
            shown = " ".join(f"{label} {_fmt(v)}" for label, v in values.items() if v is not None)
            self.console.print(f"step {step}/{self.total} {shown} eta {eta / 60:.1f} min",
                               highlight=False, soft_wrap=True)
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
