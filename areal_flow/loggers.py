"""Trackers that receive a run's metrics besides `metrics.jsonl`: TensorBoard and W&B.

A logger is any class registered in `registry.loggers` (entry-point group `areal_flow.loggers`)
that is built as ``Logger(run_dir, config=dict, start_step=int)`` and has ``log(step, metrics)``
and ``close()``; rank 0 of a recipe makes one per ``--logger`` name. Neither tracker is a
dependency: each is imported when asked for (``pip install 'areal-flow[trackers]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class MetricLogger(Protocol):
    """What `RunDir` calls; `start_step` > 0 means a resumed run continues after that step."""

    def __init__(self, run_dir: Path, *, config: dict[str, Any], start_step: int) -> None: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _require(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ModuleNotFoundError(f"--logger {module} needs the {module} package: pip install "
                                  f"{module} (or pip install 'areal-flow[trackers]')") from None


class TensorBoardLogger:
    """Scalars in `<run_dir>/tensorboard/` (``tensorboard --logdir runs/``). A resumed run
    purges the events after its checkpoint's step, as `RunDir` does with metrics.jsonl."""

    def __init__(self, run_dir: Path, *, config: dict[str, Any], start_step: int) -> None:
        _require("tensorboard")
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"),
                                    purge_step=start_step + 1 if start_step else None)
        if not start_step:
            # markdown code block: the config shows as written in config.yaml
            text = yaml.safe_dump(config, sort_keys=False)
            self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run named after the run folder, its files in `<run_dir>/wandb/`.
    The W&B run id is kept in `<run_dir>/wandb_id`, so a resumed run continues the same W&B run.
    Project, entity and mode come from W&B's own environment (`WANDB_PROJECT`, default
    areal_flow; `WANDB_MODE=offline` to sync later with `wandb sync`)."""

    def __init__(self, run_dir: Path, *, config: dict[str, Any], start_step: int) -> None:
        import os
        import uuid

        wandb = _require("wandb")
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "areal_flow"),
                              name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir),
                              config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step, commit=True)  # not held back until the next step

    def close(self) -> None:
        self.run.finish()
