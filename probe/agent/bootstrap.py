"""The fixed entry point that ``probe inject`` runs inside a target process.

The injector never generates Python from templates: the code it hands the target
(through ``sys.remote_exec`` or a gdb-scheduled pending call) is one constant
statement that runs this file by path with one datum, the path of a 0600 JSON
settings file in the 0700 runtime directory::

    {"runtime_dir": ..., "status_file": ..., "package_dirs": {"probe": ..., ...},
     "env": {"PROBE_HANG_TIMEOUT": "60"}, "cleanup": [...], "cli_python": "3.11"}

It runs on the target's main thread at a bytecode boundary (like a signal handler),
so it only does quick things: make ``probe`` importable from the CLI's installation
when the target cannot import it, check the dependencies, start the agent (which
serves on daemon threads), and write the outcome to ``status_file`` for the CLI. It
never raises and never prints into the target's output. Only the standard library
is imported before the checks pass.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time

REQUIRED = ("numpy",)  # the query engine (duckdb, sqlglot) runs in the client, never in the target


class _PackageDirs(importlib.abc.MetaPathFinder):
    """Finds probe's packages in the CLI's installation (the folders ``package-dir`` maps)."""

    def __init__(self, dirs: dict):
        self.dirs = dirs

    def find_spec(self, name, path=None, target=None):
        folder = self.dirs.get(name)
        if not folder:
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


def _write_status(path: str | None, doc: dict) -> None:
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _failed(path: str | None, **why) -> None:
    """The status of a start that failed: why, and which interpreter it was (the CLI names it in its advice)."""
    _write_status(path, {"ok": False, **why, "python": sys.version.split()[0], "executable": sys.executable})


def _make_importable(settings: dict) -> str:
    """Where ``probe`` comes from: the target's own environment, else the CLI's installation."""
    if "probe" in sys.modules or importlib.util.find_spec("probe") is not None:
        return "target"
    dirs = {k: v for k, v in (settings.get("package_dirs") or {}).items() if isinstance(v, str) and os.path.isdir(v)}
    if "probe" not in dirs:
        raise ImportError("probe is not importable in the target and the CLI's installation was not given")
    sys.meta_path.append(_PackageDirs(dirs))
    return "cli"


def main(settings_path: str) -> None:
    """Start the probe in this process as ``settings_path`` says; report to its status file."""
    status = None
    try:
        with open(settings_path) as f:
            settings = json.load(f)
        status = settings.get("status_file")
        for path in [settings_path, *settings.get("cleanup", [])]:
            try:
                os.unlink(path)
            except OSError:
                pass
        origin = _make_importable(settings)
        missing = [m for m in REQUIRED if m not in sys.modules and importlib.util.find_spec(m) is None]
        if missing:
            _failed(status, reason="missing_dependencies", missing=missing)
            return
        for key, value in (settings.get("env") or {}).items():
            if key.startswith("PROBE_") and isinstance(value, str):
                os.environ[key] = value
        from probe.agent import lifecycle  # absolute: this file runs by path (runpy), outside its package

        already = lifecycle.is_running()
        entry = lifecycle.start(runtime=None if already else settings.get("runtime_dir"))
        entry.pop("key", None)
        _write_status(
            status, {"ok": True, "already_running": already, "probe_from": origin, "entry": entry, "at": time.time()}
        )
    except BaseException as exc:  # never into the target
        try:
            _failed(status, reason="error", error=f"{type(exc).__name__}: {exc}")
        except BaseException:
            pass


if __name__ == "_probe_bootstrap" and "PROBE_SETTINGS" in globals():
    main(globals()["PROBE_SETTINGS"])
