"""Every package folder of moetune/ says in a README.md what each of its files is for (as TorchTitan's
model folders do), and no README names a Python file that is gone.

A model family's folder (``models/qwen3_moe/``) is described by its parent's README, as
``qwen3_moe/model.py``; ``__init__.py`` files need no row.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "moetune"
PY_NAME = re.compile(r"`([\w./<>-]+\.py)`")


def _package_folders() -> list[Path]:
    return sorted({path.parent for path in PACKAGE.rglob("*.py")})


def _describing_readme(folder: Path) -> tuple[Path, str]:
    """The README that describes ``folder``'s files and the prefix its rows give them."""
    if (folder / "README.md").is_file():
        return folder / "README.md", ""
    return folder.parent / "README.md", f"{folder.name}/"


def test_every_python_file_has_a_row_in_its_folders_readme():
    missing = []
    for folder in _package_folders():
        readme, prefix = _describing_readme(folder)
        if not readme.is_file():
            missing.append(f"{folder.relative_to(ROOT)}/ has no README.md")
            continue
        named = set(PY_NAME.findall(readme.read_text()))
        missing += [
            f"{readme.relative_to(ROOT)} does not name `{prefix}{path.name}`"
            for path in sorted(folder.glob("*.py"))
            if path.name != "__init__.py" and f"{prefix}{path.name}" not in named
        ]
    assert len(_package_folders()) >= 15  # moetune/ and its subpackages were found
    assert not missing, "\n".join(missing)


def test_package_readmes_name_only_existing_files():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    anywhere = {Path(line).name for line in tracked.stdout.split()} | {p.name for p in PACKAGE.rglob("*.py")}
    stale = []
    for readme in sorted(PACKAGE.rglob("README.md")):
        for name in set(PY_NAME.findall(readme.read_text())):
            if "<" in name:  # a placeholder such as `<family>/model.py`
                continue
            if "/" in name:
                exists = any((base / name).is_file() for base in (readme.parent, PACKAGE, ROOT))
            else:  # a file of this folder, or one named without its path (a test, a script)
                exists = (readme.parent / name).is_file() or name in anywhere
            if not exists:
                stale.append(f"{readme.relative_to(ROOT)} names `{name}`, which does not exist")
    assert not stale, "\n".join(stale)
