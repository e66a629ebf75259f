"""Imported by ``probe-autostart.pth`` at every interpreter start-up.

It returns at once unless ``PROBE`` is set to a true value. With ``PROBE=1`` it
starts the probe, except in processes that are not training workers: launchers
(torchrun, torch.distributed.run/launch), the ``probe`` CLI itself, pip, and
multiprocessing helpers (spawned DataLoader workers, the resource tracker). It
never raises: a .pth error must not break the user's interpreter.
"""

import os

_SKIP_SCRIPTS = {"torchrun", "probe", "pip", "pip3", "py-spy", "pytest", "py.test"}
_SKIP_MODULES = ("torch.distributed.run", "torch.distributed.launch", "torch.distributed.elastic",
                 "probe", "pip", "py_spy", "debugpy", "pytest")


def _wanted() -> bool:
    from .._config import setting
    from .._runtime import process_argv

    if not setting("PROBE"):
        return False

    argv = process_argv()[1:]  # drop the interpreter
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):
        argv = argv[1:]  # interpreter options such as -u or -X dev
    if not argv:
        return True  # an interactive interpreter
    if argv[0] == "-m":
        module = argv[1] if len(argv) > 1 else ""
        return not any(module == m or module.startswith(m + ".") for m in _SKIP_MODULES)
    if argv[0] == "-c":
        return "multiprocessing" not in " ".join(argv[1:2])  # spawned workers and helpers
    return os.path.basename(argv[0]) not in _SKIP_SCRIPTS


try:
    if _wanted():
        from .lifecycle import start

        start()
except Exception as _exc:  # pragma: no cover - reported, never raised
    import sys

    print(f"[probe] PROBE=1 could not start the probe: {_exc}", file=sys.stderr)
