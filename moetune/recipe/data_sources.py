"""Read raw rows from local JSONL / JSON / Parquet files or Hugging Face ``datasets``.

Only local data: a file, a ``save_to_disk`` directory, or a dataset already in the local
``datasets`` cache (looked up offline: the Hub is never asked). Malformed JSONL lines and JSON
rows that are no object are skipped and counted, or fail, per ``data.on_bad_row``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.utils.json_files import read_json

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class ReadStats:
    """Counts of what reading and formatting did to the rows, reported in the logs."""

    rows: int = 0
    """Rows read."""
    bad_rows: int = 0
    """Malformed rows skipped (unparseable JSON, missing or ill-typed columns)."""
    truncated: int = 0
    """Samples longer than data.max_length, cut to it."""
    answers_cut: int = 0
    """Truncated samples whose every answer token lay beyond data.max_length, dropped."""
    empty: int = 0
    """Samples whose answers have no token at all (empty answers), dropped."""
    first_cut_answer: int | None = None
    """Among ``answers_cut``: the earliest position of a first answer token (0-based)."""
    longest: int = 0
    """Tokens of the longest sample, before truncation."""
    examples: list[str] = field(default_factory=list)
    """The first few problems found, for the error message or the log."""

    def note_bad(self, message: str, *, on_bad_row: str) -> None:
        if on_bad_row == "fail":
            raise ValueError(f"{message} (set data.on_bad_row: skip to skip such rows)")
        self.bad_rows += 1
        if len(self.examples) < 3:
            self.examples.append(message)

    def note_answer_cut(self, first_answer: int) -> None:
        self.answers_cut += 1
        self.first_cut_answer = min(first_answer, self.first_cut_answer if self.first_cut_answer is not None else first_answer)

    def dropped(self, *, max_length: int) -> str:
        """What was dropped and why, in words (the start-of-run message; the error when nothing is left)."""
        parts = [f"{self.bad_rows} malformed rows skipped",
                 f"{self.truncated} samples truncated to data.max_length {max_length} tokens"]
        if self.answers_cut:
            parts.append(f"{self.answers_cut} of them dropped because truncation cut away every answer token "
                         f"(their answers start at token {self.first_cut_answer + 1} or later)")
        parts.append(f"{self.empty} samples with an empty answer dropped")
        return "; ".join(parts)

    def advice(self, *, max_length: int) -> str:
        """How to keep the samples that were dropped (for the error when none is left)."""
        hints = []
        if self.answers_cut:
            hints.append(f"raise data.max_length to at least {self.first_cut_answer + 1} (to keep an answer token) or to "
                         f"{self.longest} (the longest sample, whole)")
        if self.bad_rows:
            hints.append("fix the malformed rows (first problems: " + " | ".join(self.examples) + ")")
        if self.empty:
            hints.append("give the samples non-empty answers")
        return "; ".join(hints) or "check data.train_path"


def read_rows(path: str, *, field_name: str, split: str, on_bad_row: str, stats: ReadStats) -> list[dict[str, Any]]:
    """Rows of ``path`` as dicts. ``field_name`` (e.g. "data.train_path") names the config
    field in error messages."""
    p = Path(path)
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            rows = _read_jsonl(p, on_bad_row=on_bad_row, stats=stats)
        elif suffix == ".json":
            rows = _read_json(p, field_name=field_name, on_bad_row=on_bad_row, stats=stats)
        elif suffix == ".parquet":
            import pyarrow
            import pyarrow.parquet as pq

            try:
                rows = pq.read_table(p).to_pylist()
            except pyarrow.ArrowException as err:
                raise ValueError(f"{field_name}: {path} is not a readable Parquet file ({err})") from None
        else:
            raise ValueError(f"{field_name}: {path} has an unsupported extension {suffix!r} "
                             "(use .jsonl, .json, .parquet, or a datasets directory)")
    elif p.is_dir():
        rows = _read_datasets_dir(p, split=split, field_name=field_name)
    elif p.suffix.lower() in FILE_SUFFIXES or path.startswith(("/", "./", "../", "~")):
        raise ValueError(f"{field_name}: file {path} does not exist")
    else:
        rows = _read_datasets_cache(path, split=split, field_name=field_name)
    stats.rows += len(rows)
    return rows


def _read_jsonl(path: Path, *, on_bad_row: str, stats: ReadStats) -> list[dict[str, Any]]:
    rows = []
    with path.open("rb") as f:  # decoded line by line: a byte that is not UTF-8 spoils its row only
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                stats.note_bad(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})",
                               on_bad_row=on_bad_row)
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                stats.note_bad(f"{path}:{line_no}: not valid JSON ({err.msg})", on_bad_row=on_bad_row)
                continue
            if not isinstance(row, dict):
                stats.note_bad(f"{path}:{line_no}: a row must be a JSON object", on_bad_row=on_bad_row)
                continue
            rows.append(row)
    return rows


def _read_json(path: Path, *, field_name: str, on_bad_row: str, stats: ReadStats) -> list[dict[str, Any]]:
    try:
        data = read_json(path)
    except ValueError as err:
        raise ValueError(f"{field_name}: {err}") from None
    if not isinstance(data, list):
        raise ValueError(f"{field_name}: {path} must hold a JSON list of rows")
    rows = []
    for index, row in enumerate(data):  # as a JSONL line that is no object: a bad row, not a crash
        if not isinstance(row, dict):
            stats.note_bad(f"{path}: row {index}: a row must be a JSON object, got {type(row).__name__}",
                           on_bad_row=on_bad_row)
            continue
        rows.append(row)
    return rows


def _read_datasets_dir(path: Path, *, split: str, field_name: str) -> list[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ValueError(f"{field_name}: {path} is a directory but not a saved `datasets` dataset") from err
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{field_name}: {path} has no split {split!r} (data.split); it has {list(ds)}")
        ds = ds[split]
    return ds.to_list()


def _read_datasets_cache(name: str, *, split: str, field_name: str) -> list[dict[str, Any]]:
    import datasets

    try:
        with _hub_offline():
            ds = datasets.load_dataset(name, split=split)
    except (ConnectionError, FileNotFoundError) as err:  # not cached (offline, load_dataset finds nothing else)
        raise ValueError(f"{field_name}: {name} does not exist (and is no dataset in the local `datasets` cache "
                         f"{datasets.config.HF_DATASETS_CACHE}; nothing is downloaded)") from err
    except Exception as err:  # datasets raises many types (a cached dataset without that split, ...)
        raise ValueError(f"{field_name}: {name} does not exist as a file or directory, and the dataset of that name "
                         f"in the local `datasets` cache could not be read with data.split {split!r} "
                         f"({type(err).__name__}: {err})") from err
    return ds.to_list()


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """``datasets`` and ``huggingface_hub`` in offline mode for the block, whatever the environment says:
    ``load_dataset(name)`` then finds a dataset in the local cache and never asks the Hub.

    HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are read once, when the libraries are imported, so setting the
    environment here would change nothing: the flags are set on the modules that read them at call
    time (``datasets.config``: its offline check before each Hub call; ``huggingface_hub.constants``:
    ``is_offline_mode``, which its HTTP client checks before each request), and restored after."""
    import datasets.config
    import huggingface_hub.constants

    flags = [(module, attr) for module, attr in [
        (datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
        (huggingface_hub.constants, "HF_HUB_OFFLINE")] if hasattr(module, attr)]
    saved = [getattr(module, attr) for module, attr in flags]
    for module, attr in flags:
        setattr(module, attr, True)
    try:
        yield
    finally:
        for (module, attr), value in zip(flags, saved):
            setattr(module, attr, value)
