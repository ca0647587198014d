"""The documentation stays true to the code: every command in README.md, docs/ and benchmarks/README.md
parses (``moetune finetune`` overrides name config fields and example YAMLs load, ``moetune bench``
flags exist, scripts exist and take the flags given to them), every dotted config field the prose
names exists, every relative link and quoted repository path resolves, every file under
benchmarks/results is cited, and nothing is dated by work period. Nothing is run: the parsers only.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import glob
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from moetune.bench.cli import build_parser as bench_parser
from moetune.bench.models import CONFIGS_DIR
from moetune.cli import _finetune_parser
from moetune.options import MoetuneOptions
from moetune.recipe.config_loading import all_keys, load_config

ROOT = Path(__file__).resolve().parent.parent
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]

CONFIG_SECTIONS = ("model", "data", "optim", "training", "checkpoint", "metrics", "lora", "distributed")
REPO_PREFIXES = ("moetune/", "tests/", "benchmarks/", "examples/", "docs/", "scripts/")
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=ROOT,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return [ROOT / line for line in out.stdout.split()]


def _prose(text: str) -> str:
    """The Markdown without its fenced code blocks."""
    return FENCE.sub("", text)


def _code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [body for language, body in FENCE.findall(text) if language in languages]


def _shell_commands(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """The commands of a shell block (continuations joined, comments dropped) as (the leading
    ``NAME=value`` assignments, the words), split at ``&&``, ``||``, ``;`` and ``|``."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        env: dict[str, str] = {}
        current: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:
            if word in ("&&", "||", ";", "|"):
                if current:
                    commands.append((env, current))
                env, current = {}, []
            elif not current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word):
                name, value = word.split("=", 1)
                env[name] = value
            else:
                current.append(word)
    return commands


def _documented_commands() -> list[tuple[str, dict[str, str], list[str]]]:
    """(file, environment, words) of every command in the guides' shell blocks and inline commands."""
    inline = re.compile(r"([A-Z_]+=\S+ )*(moetune (finetune|bench)|python -m moetune|python benchmarks/|torchrun |bash benchmarks/|sbatch )")
    found = []
    for path in GUIDES:
        text = path.read_text()
        blocks = _code_blocks(text, ("bash", "sh", "shell", ""))
        blocks += [span for span in INLINE_CODE.findall(_prose(text)) if inline.match(span)]
        found += [(path.name, env, words) for block in blocks for env, words in _shell_commands(block)]
    return found


def _after_module(words: list[str], module: str) -> list[str] | None:
    """The arguments after ``-m <module>`` (``python -m`` or ``torchrun ... -m``), or None."""
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == module:
            return words[i + 2 :]
    return None


def _strict(parser: argparse.ArgumentParser, args: list[str]) -> bool:
    """Make ``parser`` fail the test on a bad argument; True when ``args`` ask for ``--help``, which
    then must print it and exit 0."""
    parser.error = lambda message: pytest.fail(f"{parser.prog} {' '.join(args)}: {message}")  # type: ignore[method-assign]
    if not {"-h", "--help"} & set(args):
        return False
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exit_:
        parser.parse_args(args)
    assert exit_.value.code == 0
    return True


def _check_finetune(args: list[str]) -> None:
    parser = _finetune_parser()
    if _strict(parser, args):
        return
    known, overrides = parser.parse_known_args(args)
    if known.help_config:
        return
    yaml_path = known.config
    if yaml_path is not None and not yaml_path.startswith("examples/"):
        yaml_path = None  # a user's own file (job.yaml): its overrides are still checked
    load_config(yaml_path=ROOT / yaml_path if yaml_path else None, overrides=overrides)


def _check_bench(args: list[str]) -> None:
    parser = bench_parser()
    if _strict(parser, args):
        return
    parsed = parser.parse_args(args)
    if not re.search(r"[/<]", parsed.config) and not parsed.config.endswith(".json"):  # <name>: a placeholder
        assert (CONFIGS_DIR / f"{parsed.config}.json").is_file(), f"no shipped bench config {parsed.config!r}"
    options = {f.name for f in dataclasses.fields(MoetuneOptions)}
    for option in parsed.moetune_option or []:
        assert option.split("=", 1)[0] in options, f"--moetune-option {option}: not a MoetuneOptions field"
    for pattern in parsed.summarize or []:
        assert glob.glob(str(ROOT / pattern)), f"--summarize {pattern}: no such file"


def _script_flags(script: Path) -> set[str]:
    """The ``--flags`` a Python script's argparse parser defines (read from its source)."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def _check_script(words: list[str], env: dict[str, str]) -> None:
    script_index = next(i for i, w in enumerate(words) if w.startswith(("benchmarks/", "examples/", "scripts/")))
    script = ROOT / words[script_index]
    assert script.is_file(), f"{words[script_index]} does not exist"
    if script.suffix == ".py":
        flags = _script_flags(script)
        given = {w.split("=", 1)[0] for w in words[script_index + 1 :] if w.startswith("--")}
        assert given <= flags, f"{script.name} has no {sorted(given - flags)}"
    if script.suffix == ".sh" and "STAGES" in env:
        # Stages as `if stage NAME` (run_h200.sh) or as the labels of `case $stage in NAME)` (user_scripts/run_gpu.sh).
        text = script.read_text()
        stages = set(re.findall(r"\bstage (\w+)", text)) | set(re.findall(r"^\s*(\w+)\)\s*$", text, re.M))
        assert set(env["STAGES"].split()) <= stages, f"{script.name} has no stage {set(env['STAGES'].split()) - stages}"


def _check_pytest(args: list[str]) -> None:
    for arg in args:
        if arg.startswith("tests"):
            assert (ROOT / arg.split("::")[0]).exists(), f"pytest {arg}: no such test file"


def _check_command(words: list[str], env: dict[str, str]) -> None:
    if words[:2] == ["moetune", "finetune"]:
        return _check_finetune(words[2:])
    if words[:2] == ["moetune", "bench"]:
        return _check_bench(words[2:])
    for module, check in (("moetune.bench", _check_bench), ("pytest", _check_pytest)):
        args = _after_module(words, module)
        if args is not None:
            return check(args)
    args = _after_module(words, "moetune.cli")
    if args is not None:
        assert args[:1] == ["finetune"], f"moetune.cli {args[:1]}: not a command"
        return _check_finetune(args[1:])
    if words[0] in ("python", "torchrun", "bash", "sbatch") and any(
        w.startswith(("benchmarks/", "examples/", "scripts/")) for w in words
    ):
        return _check_script(words, env)
    return None


def test_every_documented_command_parses():
    commands = _documented_commands()
    assert len(commands) > 40  # the guides' commands were found
    for where, env, words in commands:
        try:
            _check_command(words, env)
        except (ValueError, AssertionError) as error:
            pytest.fail(f"{where}: `{shlex.join(words)}`: {error}")


def test_the_readme_keeps_the_two_commands_ci_runs():
    """.ci/run installs and tests exactly as README.md says; it greps README.md for both lines."""
    ci = (ROOT / ".ci" / "run").read_text()
    commands = dict(re.findall(r"^(install_cmd|test_cmd)='(.+)'$", ci, re.M))
    assert set(commands) == {"install_cmd", "test_cmd"}
    readme = (ROOT / "README.md").read_text()
    for command in commands.values():
        assert command in readme, f"README.md lost {command!r}, which .ci/run runs"


def test_dotted_config_fields_named_in_the_prose_exist():
    keys = set(all_keys())
    field = rf"((?:{'|'.join(CONFIG_SECTIONS)})\.(?!(?:py|jsonl|json|yaml|md|png|txt|log)\b)[a-z_][a-z0-9_]*)"
    spans, commands = [], []
    for path in GUIDES:
        text = path.read_text()
        spans += INLINE_CODE.findall(_prose(text))
        commands += [_prose(text), *_code_blocks(text, ("bash", "sh", "shell", ""))]
    named = [m.group(1) for span in spans if (m := re.fullmatch(rf"(?:--)?{field}(?:\s*[:=]\s*\S.*|\s+\S+)?", span.strip()))]
    flags = re.findall(rf"--{field}", "\n".join(commands))
    assert len(named) > 20 and len(flags) > 20
    unknown = sorted({name for name in named + flags if name not in keys})
    assert not unknown, f"config fields the guides name that moetune/recipe/config.py lacks: {unknown}"


def test_python_examples_compile():
    for path in GUIDES:
        for i, block in enumerate(_code_blocks(path.read_text(), ("python",))):
            compile(block, f"{path.name} python block {i}", "exec")


def _link_targets(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text())) if not re.match(r"[a-z]+:|#", t)]


def test_every_relative_link_resolves():
    broken = []
    markdown = _tracked("*.md")
    for path in [*markdown, *(p for p in GUIDES if p not in markdown)]:
        for target in _link_targets(path):
            resolved = (path.parent / target.split("#")[0]).resolve()
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_quoted_repository_paths_exist():
    missing = []
    for path in GUIDES + [ROOT / "benchmarks" / "probes" / "README.md"]:
        for span in INLINE_CODE.findall(_prose(path.read_text())):
            candidate = span.split("::")[0]
            if candidate.startswith(REPO_PREFIXES) and not re.search(r"[\s<*{]", candidate):
                if not (ROOT / candidate).exists():
                    missing.append(f"{path.relative_to(ROOT)}: `{span}`")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_every_results_file_is_cited():
    """benchmarks/results keeps only what the documentation or the code cites (a file, or a folder
    holding it); figures nobody cites belong to git history."""
    results = ROOT / "benchmarks" / "results"
    cited = set()
    for path in _tracked("*.md"):
        cited |= {(path.parent / t.split("#")[0]).resolve() for t in _link_targets(path)}
    for path in _tracked("*.md", "*.py", "*.sh", "*.yaml"):
        cited |= {(ROOT / m).resolve() for m in re.findall(r"benchmarks/results/[\w./-]*[\w/]", path.read_text())}
    uncited = [
        f.relative_to(ROOT).as_posix()
        for f in sorted(results.rglob("*"))
        if f.is_file() and not ({f, *f.parents} & cited - {results.resolve()})
    ]
    assert len(list(results.rglob("*.json"))) > 20
    assert not uncited, "results nobody cites:\n" + "\n".join(uncited)


WORK_PERIOD = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\w+teenth|"
    r"twentieth|twenty-\w+|thirtieth|last|next|previous|this|that|same)\s+sessions?\b|\bsessions?\s*\d+\b|"
    r"\bsession's\b",
    re.I,
)


def _dated_by_work_period(line: str) -> bool:
    """A line that dates by work period; "session" may remain only as the POSIX process session."""
    rest = re.sub(r"start_new_session|process sessions?", "", line)
    return bool(WORK_PERIOD.search(line) or re.search(r"\bsession", rest, re.I))


def test_nothing_is_dated_by_work_period():
    """Figures and notes are dated by calendar date and commit, never by work period."""
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
        for path in _tracked("*.md", "*.py", "*.sh", "*.yaml", "*.sbatch", "*.toml")
        if path != Path(__file__).resolve()  # this file spells the patterns out
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _dated_by_work_period(line)
    ]
    assert not hits, "work-period datings:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The helpers find a bad override, an unknown bench flag, a missing script flag and a dating."""
    with pytest.raises(ValueError, match="unknown config key"):
        _check_finetune(["--training.step", "10"])
    with pytest.raises(ValueError, match="config file"):
        _check_finetune(["-c", "examples/no_such.yaml"])
    with pytest.raises(pytest.fail.Exception):
        _check_bench(["--no-such-flag"])
    with pytest.raises(AssertionError, match="--moetune-option"):
        _check_bench(["--moetune-option", "no_such_option=1"])
    with pytest.raises(AssertionError, match="has no"):
        _check_script(["python", "benchmarks/recipe_probe.py", "--no-such-flag"], {})
    with pytest.raises(AssertionError, match="has no stage"):
        _check_script(["bash", "benchmarks/run_h200.sh"], {"STAGES": "nosuchstage"})
    assert _shell_commands('OUT=/x bash a.sh && moetune finetune --a.b "" # note') == [
        ({"OUT": "/x"}, ["bash", "a.sh"]), ({}, ["moetune", "finetune", "--a.b", ""])]  # fmt: skip
    assert _dated_by_work_period("measured in the sixteenth session") and _dated_by_work_period("see session15/")
    assert _dated_by_work_period("(benchmarks/README.md, ninth and tenth sessions)")
    assert not _dated_by_work_period("start_new_session=True: a process session of its own")
