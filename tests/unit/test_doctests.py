"""Every docstring example in the package runs: one test per module that has any (found by reading the
source for ``>>>``, so a module is imported only to run its examples, never for its side effects)."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import tomllib
from pathlib import Path

import pytest

from harness import ROOT


def _modules_with_examples() -> list[str]:
    """The modules of every package pyproject.toml installs (probe.sql, probe.cli... live in their own
    folders, so a walk of probe's own folder would miss them) whose source holds an example."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
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
    module = importlib.import_module(name)
    failed, attempted = doctest.testmod(module, verbose=False, report=True)
    assert attempted, f"{name} has '>>> ' in its source but no example doctest finds (a typo in a docstring?)"
    assert not failed, f"{failed} of {attempted} examples in {name} failed (see the output above)"
