"""Helpers shared by the recipe tests (a module, not conftest, so tests can import them)."""

from __future__ import annotations

import json
from pathlib import Path

from moetune.recipe.config import DEFAULT_ASSETS


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shipped_rows(name: str, n: int) -> list[dict]:
    lines = (DEFAULT_ASSETS / "data" / name).read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]
