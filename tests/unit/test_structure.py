"""The package's structure: an import graph without cycles (top-level and in-function imports both), private
modules used only inside their package, import boundaries between rooms, every package declared in pyproject, a
pinned public API, and code that says what and why rather than which issue asked for it.

Every ``import`` and ``from ... import`` in every module of the installed package
(``probe``, ``probe.sql``, ``probe.cli``, ``probe.injector``: the folders named by
pyproject's package-dir) is an edge, wherever it stands in the module. A cycle makes a
module's dependencies unreadable from its top and works only through imports hidden in
functions, so any cycle fails the test with the modules that form it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"probe": "probe", "probe.sql": "sql", "probe.cli": "cli", "probe.injector": "injector"}


def modules(package_dirs: dict = PACKAGE_DIRS, root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is_package) for every module under the package-dir mapping."""
    found = {}
    for name, folder in package_dirs.items():
        base = root / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts]
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mod = ".".join([name, *parts]) if parts else name
            # a subfolder mapped on its own (probe.sql) wins over the same path under probe/
            found.setdefault(mod, (path, is_pkg))
    return found


def _resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(mods: dict) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module) if node.level else node.module
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                while t and t not in mods:  # `import probe.sql.guard` when only probe.sql is ours, etc.
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles():
    found = cycles(import_graph(modules()))
    assert not found, "import cycles (each line is one group of modules importing each other):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found
    )


def package_graph(graph: dict[str, set[str]], mods: dict) -> dict[str, set[str]]:
    """The import graph between rooms: a module stands for the package right below its top-level one
    (``probe.training.steps`` -> ``probe.training``), a top-level module (``probe._runtime``) for itself."""

    def room(mod: str) -> str:
        first = ".".join(mod.split(".")[:2])
        return first if first in mods and mods[first][1] else mod

    rooms: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        edges = rooms.setdefault(room(mod), set())
        edges.update(r for r in map(room, deps) if r != room(mod))
    for deps in list(rooms.values()):
        for r in deps:
            rooms.setdefault(r, set())
    return rooms


def test_no_import_cycles_between_rooms():
    # a room may import the rooms below it (util, _core, training, ...), never one that imports it: a module-level
    # test alone misses two packages importing each other through different modules
    mods = modules()
    found = cycles(package_graph(import_graph(mods), mods))
    assert not found, "rooms importing each other:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_a_planted_cycle_between_rooms_is_found():
    mods = {m: (None, True) for m in ("p", "p.a", "p.b")} | {"p.a.x": (None, False), "p.b.y": (None, False)}
    graph = {"p": set(), "p.a": set(), "p.b": set(), "p.a.x": {"p.b.y"}, "p.b.y": {"p.a"}}
    assert cycles(package_graph(graph, mods)) == [["p.a", "p.b"]]


def test_a_planted_cycle_is_found(tmp_path):
    # given: a tiny package whose two modules import each other, one of them inside a function
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import thing\n")
    (pkg / "c.py").write_text("from .a import b\n")
    # when / then
    graph = import_graph(modules({"pkg": "pkg"}, tmp_path))
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


# Private modules that code outside their package still imports, each with why it is still allowed; the
# check below fails on any other, and on an entry here that is no longer needed.
KNOWN_PRIVATE_IMPORTS: dict[str, str] = {}


def _files_outside() -> dict[str, Path]:
    """tests/ and benchmarks/ files: importers outside every package."""
    return {str(p.relative_to(ROOT)): p for folder in ("tests", "benchmarks") for p in (ROOT / folder).rglob("*.py")}


def private_imports(mods: dict, outside: dict) -> set[tuple[str, str]]:
    """(importer, private module) for each import of a ``_private`` module from outside its package.

    A module whose name (or a package above it) starts with one underscore is private to the
    package that holds it: modules in that package and below may import it, nothing else.
    """
    found = set()
    importers = [(m, p, is_pkg) for m, (p, is_pkg) in mods.items()] + [(name, p, False) for name, p in outside.items()]
    for importer, path, is_pkg in importers:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level and importer not in mods:
                    continue
                base = _resolve(importer, is_pkg, node.level, node.module) if node.level else node.module
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] != "probe":
                    continue
                k = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
                if k is None:
                    continue
                private, package = ".".join(parts[: k + 1]), ".".join(parts[:k])
                if not (importer == package or importer.startswith(package + ".")):
                    found.add((importer, private))
    return found


def test_no_private_module_is_imported_from_outside_its_package():
    found = private_imports(modules(), _files_outside())
    unexpected = sorted(
        f"  {importer} imports {private}" for importer, private in found if private not in KNOWN_PRIVATE_IMPORTS
    )
    assert not unexpected, (
        "private modules imported from outside their package (give the module a public name, "
        "or import what its package exports):\n" + "\n".join(unexpected)
    )
    stale = set(KNOWN_PRIVATE_IMPORTS) - {private for _, private in found}
    assert not stale, (
        f"no longer imported from outside their package, drop them from KNOWN_PRIVATE_IMPORTS: {sorted(stale)}"
    )


def test_a_planted_private_import_is_found(tmp_path):
    # given: probe.pkg._impl, imported by its sibling (allowed), by another package and by a test (both not)
    pkg = tmp_path / "probe"
    (pkg / "pkg").mkdir(parents=True)
    (pkg / "other").mkdir()
    for f in ("__init__.py", "pkg/__init__.py", "pkg/_impl.py", "other/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "pkg" / "api.py").write_text("from ._impl import x\n")
    (pkg / "other" / "use.py").write_text("def f():\n    from ..pkg import _impl\n")
    (tmp_path / "test_x.py").write_text("from probe.pkg._impl import x\nimport probe.pkg.api\n")
    # when
    found = private_imports(modules({"probe": "probe"}, tmp_path), {"test_x.py": tmp_path / "test_x.py"})
    # then
    assert found == {("probe.other.use", "probe.pkg._impl"), ("test_x.py", "probe.pkg._impl")}


def test_pyproject_lists_every_package():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    declared = set(cfg["packages"])
    found = set()
    for name, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found <= declared, f"packages missing from pyproject.toml: {sorted(found - declared)}"


def test_public_api_is_pinned():
    import probe

    # changing the public API is a decision: update this list on purpose, never by accident
    assert sorted(probe.__all__) == sorted(
        [
            "__version__",
            "start",
            "stop",
            "is_running",
            "info",
            "step",
            "watch",
            "span",
            "load_checkpoint",
            "load_evidence",
            "table",
            "Column",
            "rule",
            "ProbeError",
            "QueryError",
            "EndpointError",
            "AuthError",
            "ActionError",
            "AttachError",
        ]
    )
    for name in probe.__all__:
        assert hasattr(probe, name), name


def test_every_command_module_imports():
    import importlib

    from probe.cli.commands import command_modules

    assert command_modules()
    for mod in command_modules():
        importlib.import_module(f"probe.cli.commands.{mod}")


def test_rooms_respect_their_import_boundaries():
    """probe/ never imports probe.cli; sql/, cli/ and injector/ never import torch at module level."""
    import ast

    rules = {"probe": ("probe.cli",), "sql": ("torch", "probe.cli"), "cli": ("torch",), "injector": ("torch",)}
    for folder, banned in rules.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "__main__.py" and folder == "probe":
                continue  # `python -m probe` is the CLI's entry point by definition
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for n in names:
                    for b in banned:
                        if folder != "probe" or b != "torch":
                            assert not (n == b or n.startswith(b + ".")), f"{path.relative_to(ROOT)} imports {n}"


_HISTORY = re.compile(r"\b(issue|round) [0-9]+", re.IGNORECASE)


def history_mentions(roots) -> list[str]:
    """``path:line`` of each mention of an issue number or a round in the Python files under ``roots``."""
    out = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                if _HISTORY.search(line):
                    out.append(f"{path}:{n}")
    return out


def test_code_and_tests_say_what_and_why_not_which_issue_asked():
    # comments, docstrings and test names carry no history: which issue or round asked for a change is git's
    found = history_mentions(ROOT / d for d in ("probe", "sql", "cli", "injector", "tests"))
    assert not found, found


def test_a_planted_history_mention_is_found(tmp_path):
    (tmp_path / "m.py").write_text('"""What it does."""\n# fixed in ' + "ROUND" + " 3\nx = 1\n")
    assert history_mentions([tmp_path]) == [f"{tmp_path / 'm.py'}:2"]


# Module size: a file past MAX_MODULE_LINES is a sign to split it, a package of many small modules a sign to fold
# them. Every product module is held to the first; the product and its training room to a count of modules.
MAX_MODULE_LINES = 450
SIZED_MODULES = tuple(f"{room}/**/*.py" for room in ("probe", "sql", "cli", "injector"))
MAX_FILES = {"probe/training": 12}  # .py files, __init__.py included
MAX_PRODUCT_FILES = 130


def long_modules(patterns, root: Path = ROOT, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path (n lines)`` of each module matching ``patterns`` under ``root`` that is longer than ``limit``."""
    out = []
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            n = len(path.read_text().splitlines())
            if n > limit:
                out.append(f"{path.relative_to(root)} ({n} lines)")
    return out


def test_no_module_of_the_sized_rooms_is_over_the_line_limit():
    assert not long_modules(SIZED_MODULES), f"over {MAX_MODULE_LINES} lines: split by concern"


def test_the_sized_rooms_keep_within_their_module_count():
    counts = {room: len(list((ROOT / room).glob("*.py"))) for room in MAX_FILES}
    assert all(counts[room] <= most for room, most in MAX_FILES.items()), counts
    product = sum(len(list(ROOT.glob(pattern))) for pattern in SIZED_MODULES)
    assert product <= MAX_PRODUCT_FILES, f"{product} product modules: fold single-importer and tiny ones"


def test_a_planted_long_module_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 4)
    assert long_modules(("pkg/*.py",), tmp_path, limit=3) == ["pkg/long.py (4 lines)"]
