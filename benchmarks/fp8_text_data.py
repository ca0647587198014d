"""A language-modelling task whose loss settles above zero, for comparing FP8's loss with bf16's.

The default job (two-digit sums) is learned to a loss near zero, where runs of one precision at two
seeds end several times apart and a 1% criterion measures the seed. Source text has an entropy floor:
a small model's loss on it flattens at a level set by the model and the data, the same for every
seed within a fraction of a percent, and a difference of 1% there is a difference of precision.

This writes ``train.jsonl`` rows of ``{"prompt", "answer"}`` for ``moetune finetune``: consecutive
pieces of the Python standard library's source files (sorted by path, read as UTF-8), each a short
prompt and the continuation to learn. Nothing is downloaded; on one machine the rows are the same
every time (the standard library is part of the interpreter).

    python benchmarks/fp8_text_data.py --out DIR [--bytes 2000000]
    moetune finetune --data.train_path DIR/train.jsonl --data.test_path "" ...
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path


def source_text(root: Path, limit: int) -> Iterator[str]:
    """The ``.py`` files under ``root`` in path order (tests and vendored packages left out), up to
    ``limit`` characters in all."""
    taken = 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).parts
        if any(part in ("test", "tests", "idlelib", "site-packages", "dist-packages") for part in relative):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text[: limit - taken]
        taken += len(text)
        yield text
        if taken >= limit:
            return


def rows(texts: Iterator[str], *, prompt_chars: int, answer_chars: int) -> Iterator[dict[str, str]]:
    """Each text cut into consecutive pieces of ``prompt_chars + answer_chars`` characters (a text's
    shorter tail is dropped)."""
    size = prompt_chars + answer_chars
    for text in texts:
        for start in range(0, len(text) - size + 1, size):
            piece = text[start : start + size]
            yield {"prompt": piece[:prompt_chars], "answer": piece[prompt_chars:]}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for train.jsonl")
    parser.add_argument("--bytes", type=int, default=2_000_000, help="characters of source text to use")
    parser.add_argument("--prompt-chars", type=int, default=32)
    parser.add_argument("--answer-chars", type=int, default=160, help="the learned continuation (the default job's "
                        "tokenizer is byte-level: about one token a character; rows stay under max_length 256)")
    parser.add_argument("--source", default=sysconfig.get_paths()["stdlib"], help="a folder of .py files")
    args = parser.parse_args(argv)
    for flag, value in (("--bytes", args.bytes), ("--prompt-chars", args.prompt_chars), ("--answer-chars", args.answer_chars)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    source = Path(args.source)
    if not source.is_dir():
        parser.error(f"--source: no such folder: {source}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train.jsonl"
    written = 0
    with path.open("w", encoding="utf-8") as file:
        for row in rows(source_text(source, args.bytes), prompt_chars=args.prompt_chars, answer_chars=args.answer_chars):
            file.write(json.dumps(row) + "\n")
            written += 1
    if not written:
        parser.error(f"--source {source}: no .py text long enough for one row")
    print(f"wrote {written} rows from {source} to {path}")
    return path


if __name__ == "__main__":
    main()
