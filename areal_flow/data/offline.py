"""Dataset loading: local files and folders, hub datasets, registered sources (`--dataset`), and
the train/eval split by row hash. The offline demo's packaged model and GSM8K file: `packaged.py`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from areal_flow import registry
from areal_flow.types import DatasetSource


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "areal_flow"


def split_rows(rows: list[dict[str, Any]], eval_size: int) -> tuple[list[dict], list[dict]]:
    """Train/eval by row hash (deterministic, order-free); eval: the `eval_size` smallest."""
    def digest(row: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()

    ranked = sorted(rows, key=digest)
    if rows and eval_size >= len(rows):
        raise ValueError(f"--eval-size {eval_size} takes all {len(rows)} rows, leaving none to "
                         "train on: lower --eval-size (0 evaluates nothing) or give more rows")
    return ranked[eval_size:], ranked[:eval_size]


def load_rows(dataset: str, split: str) -> list[dict[str, Any]]:
    """Rows of a local json/jsonl/csv/parquet file, a saved dataset folder, or a hub dataset."""
    rows = _load_rows(dataset, split)
    if not rows:
        raise ValueError(f"--dataset {dataset}: the {split!r} split has no rows")
    return rows


_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _load_rows(dataset: str, split: str) -> list[dict[str, Any]]:
    path = Path(dataset)
    if path.suffix in _BUILDERS and not path.exists():
        raise FileNotFoundError(f"--dataset {dataset}: no such file")
    if path.suffix == ".jsonl" and path.is_file():
        return _jsonl_rows(path)  # no `datasets` import: a GPU image without it runs JSONL data
    import datasets
    if path.is_file():
        if path.suffix not in _BUILDERS:
            raise ValueError(f"--dataset {dataset}: a file must end in one of {sorted(_BUILDERS)}")
        return list(datasets.load_dataset(_BUILDERS[path.suffix], data_files=str(path),
                                          split="train"))
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        return list(loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded)
    try:
        return list(datasets.load_dataset(dataset, "main" if dataset == "openai/gsm8k" else None,
                                          split=split))
    except (ConnectionError, OSError) as error:
        raise ConnectionError(f"--dataset {dataset}: not a local file or folder, and cannot load "
                              f"split {split!r} from the Hugging Face Hub ({error}); offline, "
                              "leave --dataset unset to use the packaged GSM8K file, or pass a "
                              "local file") from error


def _jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """One JSON object a line (blank lines skipped); a bad line is named by its number."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ValueError(f"--dataset {path}, line {number}: not JSON ({error})") from None
            if not isinstance(row, dict):
                raise ValueError(f"--dataset {path}, line {number}: a row must be a JSON object, "
                                 f"not {type(row).__name__}")
            rows.append(row)
    return rows


def source(dataset: str | None) -> DatasetSource | None:
    """The registered `DatasetSource` that ``--dataset '<name>:<spec>'`` names, else None."""
    name, colon, _ = (dataset or "").partition(":")
    return registry.dataset_sources.get(name) if colon and name in registry.dataset_sources \
        else None


def train_eval_rows(dataset: str | None, eval_size: int) -> tuple[list[dict], list[dict], str]:
    """(train rows, eval rows, where they come from): a registered `source`'s, the packaged GSM8K
    file's (None), a local file or folder split like it, or a hub dataset's train/test splits."""
    if (named := source(dataset)) is not None:
        return named.train_eval_rows(dataset, eval_size)
    if dataset is None:
        from areal_flow.data.packaged import gsm8k_offline_split

        return gsm8k_offline_split(eval_size)
    if Path(dataset).exists():
        train, evaluation = split_rows(load_rows(dataset, "train"), eval_size)
    else:
        train = load_rows(dataset, "train")
        evaluation = load_rows(dataset, "test")[:eval_size]
    return train, evaluation, f"data: {dataset}, {len(train):,} train / " \
        f"{len(evaluation):,} eval rows"
