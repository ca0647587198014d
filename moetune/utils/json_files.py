"""JSON files read with errors that name the file, and the line and column of a syntax error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; a file that is not UTF-8 or not JSON raises a ValueError naming
    the file and where in it (a bare ``JSONDecodeError`` names neither)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path} is not UTF-8 text: byte 0x{data[err.start]:02x} at line {line}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
