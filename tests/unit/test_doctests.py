"""Every docstring example in the package runs: one test per module that has any (found by reading the
source for ``>>>``, so a module is imported only to run its examples, never for its side effects). A module whose
import or examples need what ``pip install -e .`` does not install (torch, mcp: pyproject's optional dependencies)
is skipped where that is missing; a missing required dependency fails."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import re
import tomllib
from pathlib import Path

import pytest

from harness import ROOT


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
REQUIRED = {"probe"} | {
    re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).replace("-", "_")
    for requirement in PYPROJECT["project"]["dependencies"]
}


def _optional_missing(name: str) -> str | None:
    """The module that module ``name``'s import or examples need and that is neither installed nor one of probe's
    required dependencies (whose absence is a failure), or None."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in REQUIRED:
            return e.name
        raise
    source = Path(module.__file__).read_text(encoding="utf-8")
    for imported in re.findall(r"^\s*>>> (?:import|from) ([A-Za-z_]\w*)", source, re.M):
        if imported not in REQUIRED and importlib.util.find_spec(imported) is None:
            return imported
    return None


def _modules_with_examples() -> list[str]:
    """The modules of every package pyproject.toml installs (probe.sql, probe.cli... live in their own
    folders, so a walk of probe's own folder would miss them) whose source holds an example."""
    packages = PYPROJECT["tool"]["setuptools"]["packages"]
    found = []
    for package in packages:
        folder = Path(importlib.util.find_spec(package).submodule_search_locations[0])
        for name, path in [(package, folder / "__init__.py")] + [
            (f"{package}.{m.name}", folder / f"{m.name}.py") for m in pkgutil.iter_modules([str(folder)]) if not m.ispkg
        ]:
            if path.exists() and ">>> " in path.read_text(encoding="utf-8"):
                found.append(name)
    return sorted(found)


MODULES = _modules_with_examples()


def test_the_package_has_examples_to_run():
    assert len(MODULES) >= 20, MODULES  # the walk found the package's modules (a broken walk would run nothing)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    missing = _optional_missing(name)
    if missing:
        pytest.skip(f"{name} needs {missing}, which is not installed (an optional dependency)")
    module = importlib.import_module(name)
    failed, attempted = doctest.testmod(module, verbose=False, report=True)
    assert attempted, f"{name} has '>>> ' in its source but no example doctest finds (a typo in a docstring?)"
    assert not failed, f"{failed} of {attempted} examples in {name} failed (see the output above)"
