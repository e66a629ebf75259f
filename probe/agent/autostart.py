"""Imported by ``probe-autostart.pth`` at every interpreter start-up.

It returns at once unless ``PROBE`` is set; which processes of a launch tree then start a probe (``PROBE=1``,
``PROBE=all``, ``PROBE_ONLY``) is docs/attach.md's table, "Which processes PROBE starts in". A process that
starts a probe this way exports ``PROBE_PARENT`` (its pid) to its children. It never raises: a .pth error must
not break the user's interpreter.
"""

import os

PARENT = "PROBE_PARENT"

_SKIP_SCRIPTS = {"torchrun", "probe", "pip", "pip3", "py-spy", "pytest", "py.test"}
_SKIP_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "torch.distributed.elastic",
    "probe",
    "pip",
    "py_spy",
    "debugpy",
    "pytest",
)


def _kind(argv: list[str]) -> tuple[str, bool]:
    """(the script's name or the -m module, whether it is a process probe never starts in by default)."""
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):
        argv = argv[1:]  # interpreter options such as -u or -X dev
    if not argv:
        return "", False  # an interactive interpreter
    if argv[0] == "-m":
        module = argv[1] if len(argv) > 1 else ""
        return module, any(module == m or module.startswith(m + ".") for m in _SKIP_MODULES)
    if argv[0] == "-c":
        return "-c", "multiprocessing" in " ".join(argv[1:2])  # spawned workers and helpers
    name = os.path.basename(argv[0])
    return name, name in _SKIP_SCRIPTS


def _wanted() -> bool:
    from ..config import setting
    from .._identity import process_argv
    from ..util.procfs import pid_alive

    mode = setting("PROBE")
    if not mode:
        return False
    name, skipped = _kind(process_argv()[1:])  # drop the interpreter
    only = setting("PROBE_ONLY")
    if only:
        from fnmatch import fnmatchcase

        return any(fnmatchcase(name, p) for p in only)
    if skipped:
        return False
    if mode == "workers":
        parent = os.environ.get(PARENT, "")
        if parent.isdigit() and int(parent) != os.getpid() and pid_alive(int(parent)):
            return False  # started by a probed process: a compile worker, a data or eval subprocess
    return True


try:
    if _wanted():
        from .lifecycle import start

        start()
        os.environ[PARENT] = str(os.getpid())  # children see that they were started by a probed process
except Exception as _exc:  # pragma: no cover - reported, never raised
    import sys

    print(f"[probe] PROBE=1 could not start the probe: {_exc}", file=sys.stderr)
