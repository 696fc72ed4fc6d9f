"""A training run's folder: `RunConfig` (the options every recipe shares) and `RunDir`
(config.yaml, metrics/samples/eval_samples.jsonl, checkpoints/step-N/, logs, tracker files)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from attrs import validators as v

from areal_flow import registry
from areal_flow.config import dump, unstructure
from areal_flow.run_lock import RunLock

COMPLETE = "COMPLETE"
"""A checkpoint's marker, written once all is on disk: a manifest of file sizes and SHA-256s."""


@attrs.frozen(kw_only=True)
class RunConfig:
    """The options every recipe shares: what to train on, for how long, where the run lives."""

    model: str | None = None
    """HF folder or hub id; default: the packaged SmolLM2-135M-Instruct (converted once)."""
    dataset: str | None = None
    """openai/gsm8k, a local json/jsonl/parquet file, a saved HF dataset, or a reasoning-gym task
    as 'reasoning_gym:<task>?key=value&...'; default: the packaged GSM8K file, split in two."""
    eval_size: int = attrs.field(default=16, validator=v.ge(0))
    """Held-out rows evaluated; 0 turns eval off."""
    eval_every: int = attrs.field(default=8, validator=v.ge(1))
    """Steps between evals (one also runs before training and after the last step)."""
    steps: int = attrs.field(default=24, validator=v.ge(1))
    """Training steps (one batch each)."""
    save_every: int = attrs.field(default=8, validator=v.ge(1))
    """Steps between checkpoints (one is also written at the end and on Ctrl-C / SIGTERM)."""
    keep_checkpoints: int = attrs.field(default=2, validator=v.ge(0))
    """Newest complete checkpoints kept (2: a damaged newest one leaves another); 0: all."""
    run_dir: str | None = None
    """Run folder; default runs/<run name>-<time> (RL recipes: <task>_<algorithm>)."""
    resume: bool = False
    """Continue the run in --run-dir from its newest checkpoint."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    logger: tuple[str, ...] = ()
    """Trackers that also get the metrics (registered loggers: tensorboard, wandb)."""

    def __attrs_post_init__(self) -> None:
        if self.resume and self.run_dir is None:
            raise ValueError("--resume needs --run-dir: the folder of the run to continue")
        for name in self.logger:
            registry.loggers.get(name)  # an unknown name fails now, with suggestions


class RunDir:
    """The run folder; a new run (not `resume`) refuses one that already holds a run."""

    def __init__(self, path: str | Path, *, resume: bool = False, keep_checkpoints: int = 0,
                 lock: bool = False):
        """`lock`: hold the folder until `close` (`RunLock`); refuses one another run holds."""
        self.path = Path(path)
        self.resume = resume
        self.keep_checkpoints = keep_checkpoints
        self.loggers: list[Any] = []
        if resume and not self.path.is_dir():
            raise FileNotFoundError(f"--resume: no run folder at {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        # first: a live holder is the reason to name, whatever the folder holds
        self._lock = RunLock(self.path) if lock else None
        if not resume and (self.path / "metrics.jsonl").exists():
            self.close()
            raise FileExistsError(f"{self.path} already holds a run: pass --resume to continue it "
                                  "or choose another --run-dir")
        self.checkpoints = self.path / "checkpoints"
        self.resume_from = self.latest_checkpoint() if resume else None
        """The checkpoint a resume starts from: (step, folder)."""
        if resume and self.resume_from is None:
            # refused now, before any model loads, rather than start over in a folder whose
            # metrics and checkpoint folders would then be overwritten
            folders = sorted(p.name for p in self.checkpoints.glob("step-*"))
            self.close()
            raise FileNotFoundError(
                f"--resume: no complete, undamaged checkpoint in {self.checkpoints} (folders: "
                f"{', '.join(folders) or 'none'}); nothing was changed. To start this run over, "
                f"delete {self.path} or choose another --run-dir")

    @staticmethod
    def default_path(recipe: str) -> Path:
        return Path("runs") / f"{recipe}-{datetime.now():%Y%m%d-%H%M%S}"

    def write_config(self, config: Any, note: str = "") -> None:
        """config.yaml; `note` (what was measured at start, say) heads it as comments."""
        file = self.path / "config.yaml"
        dump(config, file)
        file.write_text("".join(f"# {line}\n" for line in note.splitlines()) + file.read_text())

    def start_loggers(self, names: Iterable[str], config: Any, step: int) -> None:
        self.loggers = [registry.loggers.get(name)(self.path, config=unstructure(config),
                                                   start_step=step) for name in names]

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._append("metrics.jsonl", step, [metrics])
        numbers = {k: float(x) for k, x in metrics.items()
                   if isinstance(x, (int, float)) and not isinstance(x, bool)}
        for logger in self.loggers:
            logger.log(step, numbers)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def log_samples(self, step: int, samples: Iterable[dict[str, Any]]) -> None:
        self._append("samples.jsonl", step, samples)

    def log_eval_samples(self, step: int, samples: Iterable[dict[str, Any]]) -> None:
        self._append("eval_samples.jsonl", step, samples)

    def has_checkpoint(self, step: int) -> bool:
        """A complete checkpoint of `step` is there (rank 0's view, given to every rank)."""
        from areal_flow.runtime.distributed import same_on_all_ranks

        return same_on_all_ranks((self.checkpoint_dir(step) / COMPLETE).exists())

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """The newest complete, undamaged checkpoint: (step, folder), or None."""
        for path in reversed(self._complete()):
            damage = checkpoint_damage(path)
            if damage is None:
                return int(path.name.split("-")[1]), path
            warnings.warn(f"skipping damaged checkpoint {path}: {damage}", stacklevel=2)
        return None

    def save_checkpoint(self, step: int, trainer: Any, *, extra: Any = None,
                        tokenizer_from: str | Path | None = None, critic: Any = None) -> Path:
        """Exact-resume state of `trainer` (and `critic`, in `critic/`) with `extra`, plus a
        `save_pretrained` policy in `hf/`; marked complete, then pruned. Every rank calls."""
        from areal_flow.runtime import checkpoint

        path = self.checkpoint_dir(step)
        try:
            path.mkdir(parents=True, exist_ok=True)
            checkpoint.save_checkpoint(trainer, path, extra_state=extra)
            if critic is not None:
                (path / "critic").mkdir(exist_ok=True)
                checkpoint.save_checkpoint(critic, path / "critic")
            checkpoint.save_hf(trainer, path / "hf", tokenizer_from=tokenizer_from)
        except (OSError, RuntimeError, CheckpointException) as error:  # a full disk, as
            # torch.save (RuntimeError "unexpected pos") or distributed checkpoint reports it
            raise self._unwritten(path, error) from error
        dist.barrier()  # every rank's shard is written before rank 0 lists the folder
        if trainer.rank == 0:
            mark_complete(path)
            self.prune(path)
        dist.barrier()
        return path

    def _unwritten(self, path: Path, error: BaseException) -> OSError:
        """Removes half-written `path`; returns an error naming the space needed and free."""
        written = _folder_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        complete = self._complete()
        needed = _folder_bytes(complete[-1]) if complete else None
        free = shutil.disk_usage(self.checkpoints if self.checkpoints.exists()
                                 else self.path).free
        size = (f"a checkpoint takes {_size(needed)} ({complete[-1].name})" if needed
                else f"{_size(written)} were written before it failed")
        cause = str(error).strip().splitlines()[-1]  # a distributed checkpoint's: per rank
        message = (f"checkpoint {path} could not be written ({cause}); {size}, and "
                   f"{_size(free)} are free on its filesystem. The half-written folder was "
                   f"removed; earlier checkpoints are intact. Free space (or lower "
                   f"--keep-checkpoints), then --resume")
        code = getattr(error, "errno", None)
        return OSError(code, message) if code else OSError(message)

    def prune(self, newest: Path) -> None:
        """Keep `newest` and the `keep_checkpoints` - 1 complete ones before; delete the rest."""
        if not self.keep_checkpoints:
            return
        complete = [p for p in self._complete() if p != newest]
        kept = complete[max(0, len(complete) + 1 - self.keep_checkpoints):]
        for old in sorted(self.checkpoints.glob("step-*")):
            if old != newest and old not in kept:
                shutil.rmtree(old, ignore_errors=True)

    def _complete(self) -> list[Path]:
        """The marked checkpoint folders, oldest first."""
        return sorted(p for p in self.checkpoints.glob("step-*") if (p / COMPLETE).exists())

    def load_checkpoint(self, trainer: Any, *, critic: Any = None) -> tuple[int, Any]:
        """Restore `resume_from` into `trainer` (and `critic`) on every rank: (step, extra)."""
        if self.resume_from is None:
            raise RuntimeError("load_checkpoint needs a RunDir opened with resume=True")
        from areal_flow.runtime import checkpoint

        step, path = self.resume_from
        extra = checkpoint.load_checkpoint(trainer, path)
        if critic is not None:
            checkpoint.load_checkpoint(critic, path / "critic")
        return step, extra

    def truncate_after(self, step: int) -> None:
        """Drop logged lines after `step` and a cut-short last line; an earlier bad line raises."""
        for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):
            file = self.path / name
            if not file.exists():
                continue
            lines = file.read_text().splitlines()
            kept = []
            for number, line in enumerate(lines, 1):
                try:
                    record = json.loads(line) if line else None
                except ValueError:
                    if number == len(lines):
                        warnings.warn(f"{file}: dropped its unfinished last line", stacklevel=2)
                        break
                    raise ValueError(f"{file}, line {number} is not JSON: {line[:80]!r}") from None
                if record is not None and record["step"] <= step:
                    kept.append(line)
            file.write_text("".join(f"{line}\n" for line in kept))

    def _append(self, name: str, step: int, records: Iterable[dict[str, Any]]) -> None:
        with open(self.path / name, "a") as f:
            for record in records:
                f.write(json.dumps({"step": step, **record}, default=_jsonable) + "\n")


def _jsonable(value: Any) -> float | str:
    """A number as a float, anything else as its str: a log line never fails the run."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GB" if count >= 2**30 else f"{count / 2**20:.1f} MB"


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) \
        if folder.exists() else 0


def mark_complete(path: Path) -> None:
    """Flush every file of checkpoint `path`, then atomically write its COMPLETE manifest (sizes,
    SHA-256): a marked checkpoint is whole after a crash (hashing SmolLM2's takes about 2 s)."""
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name != COMPLETE)
    manifest = {}
    for file in files:
        with open(file, "rb") as f:
            os.fsync(f.fileno())
            manifest[str(file.relative_to(path))] = {
                "bytes": file.stat().st_size,
                "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    tmp = path / f".{COMPLETE}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / COMPLETE)
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with marked checkpoint `path` against its manifest, or None."""
    text = (path / COMPLETE).read_text()
    if not text.strip():
        return None  # a marker from before manifests
    try:
        manifest = json.loads(text)
    except ValueError:
        return f"its {COMPLETE} marker is not a manifest"
    for name, saved in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = saved["bytes"] if isinstance(saved, dict) else saved  # sizes only: older runs
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} when it was saved"
        if isinstance(saved, dict):
            try:
                with open(file, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as error:
                return f"{name} cannot be read ({error})"
            if digest != saved["sha256"]:
                return f"{name} differs from what was saved (its SHA-256 changed)"
    return None
