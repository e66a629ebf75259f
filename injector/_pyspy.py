"""Read-only stacks of any local Python process through ``py-spy dump --json`` (and
sampled over time through ``py-spy record``, for ``probe profile --native``).

py-spy reads the target's memory (process_vm_readv) without running code in it, so
it works on a rank stuck in C with the GIL held, where no Python thread can answer.
The result has the shape of the server's ``GET /backtrace``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from probe._errors import AttachError
from probe.util.printable import stack_text

from ._process import EXIT_CODES, explain_ptrace_failure, inspect_process, ptrace_problem


def pyspy_path() -> str | None:
    """The py-spy executable next to this interpreter, else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def _usable_pyspy(pid: int, without: str, verb: str) -> str:
    """py-spy's path, once it is known to exist and to be allowed to ptrace ``pid``; else AttachError."""
    exe = pyspy_path()
    if exe is None:
        raise AttachError(
            f"py-spy is not installed, so {without}; `pip install py-spy` in the CLI's environment.",
            exit_code=EXIT_CODES["no_rung"],
        )
    blocked = ptrace_problem(pid)
    if blocked:
        raise AttachError(f"py-spy cannot {verb} process {pid}: {blocked}.", exit_code=EXIT_CODES["ptrace_blocked"])
    return exe


def _frame(depth: int, f: dict) -> dict:
    native = f.get("module") is not None  # py-spy sets `module` (the shared object) only for native frames
    out = {
        "depth": depth,
        "func": f.get("name"),
        "file": f.get("filename"),
        "lineno": f.get("line") or None,
        "line": None,
    }
    if native:
        out["native"] = True
        out["file"] = f.get("module") or f.get("filename")
        if f.get("filename") and f.get("filename") != f.get("module") and f.get("line"):
            out["file"] = f.get("filename")  # a C source file with debug info
        else:
            out["lineno"] = None
    elif out["file"] and out["lineno"]:
        import linecache

        out["line"] = linecache.getline(out["file"], out["lineno"]).strip() or None
    return out


def _thread(t: dict) -> dict:
    native_id = t.get("os_thread_id")
    pid = t.get("pid")
    states = ["running" if t.get("active") else "idle"]
    if t.get("owns_gil"):
        states.append("holds the GIL")
    return {
        "thread_id": t.get("thread_id"),
        "native_id": native_id,
        "pid": pid,
        "name": t.get("thread_name"),
        "is_main": native_id is not None and native_id == pid,
        "daemon": None,
        "state": ", ".join(states),
        "frames": [_frame(i, f) for i, f in enumerate(t.get("frames") or [])],
    }


def pyspy_backtrace(
    pid: int, *, native: bool = False, subprocesses: bool = False, thread: str | None = None, timeout: float = 10.0
) -> dict:
    """Every thread's stack of ``pid`` read by py-spy, innermost frame first, shaped like GET /backtrace."""
    info = inspect_process(pid)
    exe = _usable_pyspy(pid, "stacks cannot be read without the probe server", "read")
    argv = [exe, "dump", "--pid", str(pid), "--json"]
    if native:
        argv.append("--native")
    if subprocesses:
        argv.append("--subprocesses")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AttachError(
            f"py-spy did not finish reading process {pid} within {timeout:g} s; retry, or use "
            "--timeout to wait longer.",
            exit_code=EXIT_CODES["no_answer"],
        ) from None
    if proc.returncode != 0:
        text = (proc.stderr or proc.stdout).strip()
        why = explain_ptrace_failure(pid, text)
        if why:
            raise AttachError(f"py-spy cannot read process {pid}: {why}.", exit_code=EXIT_CODES["ptrace_blocked"])
        last = text.splitlines()[-1] if text else f"exit status {proc.returncode}"
        raise AttachError(
            f"py-spy could not read process {pid} (Python {info.version_text}): {last}; "
            "check that py-spy supports this Python (`pip install -U py-spy`).",
            exit_code=EXIT_CODES["tool_failed"],
        )
    try:
        raw = json.loads(proc.stdout)
    except ValueError:
        raise AttachError(
            f"py-spy printed something other than JSON for process {pid}; upgrade it with `pip install -U py-spy`.",
            exit_code=EXIT_CODES["tool_failed"],
        ) from None
    threads = [_thread(t) for t in raw if isinstance(t, dict)]
    if thread not in (None, ""):
        threads = [t for t in threads if thread in (t["name"], str(t["thread_id"]), str(t["native_id"]))]
        if not threads:
            names = ", ".join(sorted({str(t.get("thread_name")) for t in raw if isinstance(t, dict)}))
            raise AttachError(
                f"process {pid} has no thread named or numbered {thread!r}; threads: {names}.",
                exit_code=EXIT_CODES["tool_failed"],
            )
    threads.sort(key=lambda t: (t["pid"] != pid, not t["is_main"], t["pid"] or 0, t["name"] or ""))
    return {"source": "py-spy", "pid": pid, "rank": None, "threads": threads}


def pyspy_record(pid: int, seconds: float, *, hz: float = 100.0, native: bool = True) -> list:
    """Every thread of ``pid`` sampled by ``py-spy record`` for ``seconds``: ``[[stack, count], ...]``.

    Stacks are collapsed and root first (``thread (id): name;func (file:line);...``), one
    box per function (``--function``), idle threads included. py-spy pauses the process
    for each sample unless sampling without ``--native``.
    """
    import tempfile

    exe = _usable_pyspy(pid, "native stacks cannot be sampled (or drop --native)", "sample")
    with tempfile.TemporaryDirectory(prefix="probe-profile-") as tmp:
        out = os.path.join(tmp, "stacks.txt")
        argv = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, round(seconds))),
            "--rate",
            str(int(hz)),
            "--format",
            "raw",
            "--output",
            out,
            "--function",
            "--threads",
            "--idle",
        ]
        if native:
            argv.append("--native")
        else:
            argv.append("--nonblocking")
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            raise AttachError(
                f"py-spy did not finish sampling process {pid} within {seconds + 30:g} s.",
                exit_code=EXIT_CODES["no_answer"],
            ) from None
        if proc.returncode != 0 or not os.path.exists(out):
            text = (proc.stderr or proc.stdout).strip()
            why = explain_ptrace_failure(pid, text) or (
                text.splitlines()[-1] if text else f"exit status {proc.returncode}"
            )
            raise AttachError(f"py-spy could not sample process {pid}: {why}.", exit_code=EXIT_CODES["tool_failed"])
        with open(out) as f:
            lines = f.read().splitlines()
    stacks = []
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            stacks.append([stack_text(stack), int(count)])
    return sorted(stacks, key=lambda s: -s[1])
