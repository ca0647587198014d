"""``benchmarks/fp8_text_data.py``: the source-text task FP8's loss is compared on (rows the recipe reads,
the same rows every time, tests and vendored code left out, a clear error for an unusable source)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_benchmark_script


@pytest.fixture(scope="module")
def text_data():
    return load_benchmark_script("fp8_text_data")


def _source(root: Path) -> Path:
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("A" * 25)
    (root / "pkg" / "b.py").write_text("B" * 12)
    (root / "pkg" / "tests" / "test_a.py").write_text("T" * 50)
    return root


def test_rows_are_consecutive_pieces_of_the_sources_in_path_order(text_data, tmp_path):
    source = _source(tmp_path / "src")
    argv = ["--source", str(source), "--prompt-chars", "4", "--answer-chars", "6", "--bytes", "1000"]
    first = text_data.main([*argv, "--out", str(tmp_path / "one")]).read_text()
    assert text_data.main([*argv, "--out", str(tmp_path / "two")]).read_text() == first
    rows = [json.loads(line) for line in first.splitlines()]
    # a.py: two pieces of 10 (its last 5 characters dropped), b.py: one; tests/ left out
    assert rows == [{"prompt": "AAAA", "answer": "AAAAAA"}] * 2 + [{"prompt": "BBBB", "answer": "BBBBBB"}]
    limited = text_data.main([*argv[:-1], "20", "--out", str(tmp_path / "three")]).read_text()
    assert len(limited.splitlines()) == 2  # 20 characters of a.py: two rows, nothing from b.py


def test_an_unusable_source_is_named(text_data, tmp_path, capsys):
    with pytest.raises(SystemExit):
        text_data.main(["--source", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert "--source: no such folder" in capsys.readouterr().err
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "x.py").write_text("x = 1\n")
    with pytest.raises(SystemExit):
        text_data.main(["--source", str(tmp_path / "short"), "--out", str(tmp_path / "out")])
    assert "no .py text long enough for one row" in capsys.readouterr().err


def test_the_standard_library_gives_rows_under_the_recipes_length(text_data, tmp_path):
    path = text_data.main(["--out", str(tmp_path), "--bytes", "20000"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert 50 <= len(rows) <= 20000 // 192  # whole rows only, each file's tail dropped
    assert all(len(row["prompt"]) == 32 and len(row["answer"]) == 160 for row in rows)
