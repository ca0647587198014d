"""No import cycles inside moetune/: every module's imports, read with ``ast``, form a graph without a
circle.

Function-level imports count as much as module-level ones (and so do ``if TYPE_CHECKING:`` ones):
the three cycles this test was written against (``auto`` <-> ``distributed.parallelize``,
``bench.lora`` <-> ``bench.models``, ``distributed.vocab_parallel`` <->
``layers.linear_cross_entropy``) all ran through imports deferred into a function, which hides a
circle from Python without removing it. Importing ``a.b.c`` also runs the ``__init__`` of ``a.b``,
so an import counts as an edge to each package that contains the imported module as well, except
the importer's own packages (which are already being imported when it runs).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's ``__init__``) for every .py file under root/package."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _imported_names(tree: ast.AST, own_package: str) -> set[str]:
    """The dotted names a module imports anywhere in its body (relative imports made absolute);
    ``from p import x`` gives ``p.x``, which ``_known`` trims to ``p`` where x is no module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = own_package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _known(name: str, modules: dict) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (None for other libraries)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules and packages of ``package`` that importing it runs."""
    modules = module_files(root, package)
    graph = {}
    for name, (path, is_package) in modules.items():
        parts = name.split(".")
        own_package = name if is_package else ".".join(parts[:-1])
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts) + is_package)}
        edges = set()
        for imported in _imported_names(ast.parse(path.read_text(), filename=str(path)), own_package):
            target = _known(imported, modules)
            if target is None:
                continue
            target_parts = target.split(".")
            for i in range(1, len(target_parts) + 1):  # the target and the packages whose __init__ it runs
                step = ".".join(target_parts[:i])
                if step in modules and step not in ancestors and step != name:
                    edges.add(step)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One shortest import cycle (its modules, the first repeated at the end), or None."""
    best = None
    for start in sorted(graph):
        parent = {start: None}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if start in graph[node]:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                cycle = [*reversed(path), start]
                if best is None or len(cycle) < len(best):
                    best = cycle
                break
            for nxt in sorted(graph[node]):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
    return best


def test_moetune_has_no_import_cycle():
    graph = import_graph(ROOT, "moetune")
    assert len(graph) > 100 and "moetune.auto" in graph["moetune"]  # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in moetune/: " + " -> ".join(cycle)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """The shape of the cycles this test replaced: one side imports the other inside a function."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.sub import helper\n",
        "pkg/sub/__init__.py": "from pkg.sub.helpers import helper\n",
        "pkg/sub/helpers.py": "def helper():\n    from pkg import a  # deferred\n    return a\n",
        "pkg/leaf.py": "import os\nfrom . import a\n",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.leaf"] == {"pkg.a"}  # a relative import resolved; other libraries ignored
    assert graph["pkg.a"] == {"pkg.sub"}  # a name re-exported by a package: the package's __init__
    assert find_cycle(graph) == ["pkg.a", "pkg.sub", "pkg.sub.helpers", "pkg.a"]


def test_importing_a_submodule_runs_its_packages_init(tmp_path):
    """``import p.q.m`` runs ``p/q/__init__``: a cycle through a package's re-exports is one too,
    while a module importing its own package's siblings is not."""
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.q import thing\n",
        "pkg/q/__init__.py": "from pkg.q.m import thing\nfrom pkg.q import n\n",
        "pkg/q/m.py": "thing = 1\n",
        "pkg/q/n.py": "from pkg.q.m import thing\n",
        "pkg/r.py": "from pkg.q.m import thing\n",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.r"] == {"pkg.q", "pkg.q.m"} and find_cycle(graph) is None
    _write(tmp_path, {"pkg/q/m.py": "import pkg.r\nthing = 1\n"})
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.q.m", "pkg.r", "pkg.q.m"]
