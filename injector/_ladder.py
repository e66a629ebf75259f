"""The attach ladder: ``sys.remote_exec`` (Python 3.14+), then gdb, else a plain refusal.

Both rungs hand the target the same constant statement (``BOOT_CODE``) with two data:
the path of ``probe/agent/bootstrap.py`` and the path of a 0600 JSON settings file in
the 0700 runtime directory. The statement runs at a bytecode boundary on the
target's main thread, with the GIL held by the interpreter's own rules:

* ``sys.remote_exec`` schedules a script file for the next safe point (PEP 768).
* gdb stops the process only long enough to ``mmap`` one private page, copy the
  statement into it, and call ``Py_AddPendingCall(PyRun_SimpleString, page)``.
  It never takes the GIL and never runs Python at the ptrace stop, so it cannot
  deadlock on a lock the stopped thread holds; the interpreter runs the pending
  call itself at its next eval-breaker check, exactly like a signal handler.

The bootstrap reports through a status file, which ``inject`` waits for.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time

from probe.config import setting
from probe._errors import AttachError
from probe._runtime import read_entries, runtime_dir, sweep_stale

from ._process import EXIT_CODES, ProcessInfo, cli_version, explain_ptrace_failure, inspect_process, ptrace_problem


RUNGS = ("remote_exec", "gdb")

# The one statement the target runs; only the two paths vary, inserted with repr().
BOOT_CODE = (
    "try:\n"
    "    __import__('runpy').run_path({boot!r}, {{'PROBE_SETTINGS': {settings!r}}}, '_probe_bootstrap')\n"
    "except BaseException:\n"
    "    pass\n"
)


def _package_dirs() -> dict:
    import probe

    dirs = {}
    for name in ("probe", "probe.sql", "probe.cli", "probe.injector"):
        try:
            mod = __import__(name, fromlist=["_"]) if name != "probe" else probe
            dirs[name] = list(mod.__path__)[0]
        except ImportError:
            continue
    return dirs


def _private_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class _Payload:
    """The private files of one injection: settings (JSON), the statement, and the status the bootstrap writes."""

    def __init__(self, pid: int, env: dict):
        self.dir = runtime_dir()
        stem = os.path.join(self.dir, f"inject-{pid}-{secrets.token_hex(4)}")
        self.settings, self.code_file, self.status = stem + ".json", stem + ".py", stem + ".status"
        boot = os.path.join(os.path.dirname(os.path.abspath(__import__("probe").__file__)), "agent", "bootstrap.py")
        self.code = BOOT_CODE.format(boot=boot, settings=self.settings)
        doc = {
            "runtime_dir": self.dir,
            "status_file": self.status,
            "package_dirs": _package_dirs(),
            "env": env,
            "cleanup": [self.code_file],
            "cli_python": "%d.%d" % cli_version(),
        }
        _private_file(self.settings, json.dumps(doc).encode())
        _private_file(self.code_file, self.code.encode() + b"\0")

    def discard(self) -> None:
        for path in (self.settings, self.code_file, self.status):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _remote_exec_unavailable(info: ProcessInfo) -> str | None:
    if info.version < (3, 14):
        return f"sys.remote_exec needs Python 3.14 or newer and the target runs {info.version_text}"
    if not hasattr(sys, "remote_exec"):
        return "this Python has no sys.remote_exec"
    try:
        with open(f"/proc/{info.pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        env = {}
    if env.get(b"PYTHON_DISABLE_REMOTE_DEBUG"):
        return "the target disabled remote debugging (PYTHON_DISABLE_REMOTE_DEBUG is set in its environment)"
    if "disable_remote_debug" in " ".join(info.cmdline):
        return "the target disabled remote debugging (-X disable_remote_debug)"
    if os.environ.get("PYTHON_DISABLE_REMOTE_DEBUG"):
        return "remote debugging is disabled for this CLI (PYTHON_DISABLE_REMOTE_DEBUG is set)"
    return None


def _remote_exec(info: ProcessInfo, payload: _Payload) -> None:
    try:
        sys.remote_exec(info.pid, payload.code_file)  # type: ignore[attr-defined]
    except PermissionError as exc:
        why = explain_ptrace_failure(info.pid, str(exc)) or str(exc)
        raise AttachError(
            f"sys.remote_exec was refused for process {info.pid}: {why}.", exit_code=EXIT_CODES["ptrace_blocked"]
        ) from None
    except (OSError, RuntimeError) as exc:
        raise AttachError(
            f"sys.remote_exec failed for process {info.pid} ({exc}); retry, or set PROBE_INJECT_VIA=gdb.",
            exit_code=EXIT_CODES["tool_failed"],
        ) from None


def _gdb_path() -> str | None:
    import shutil

    gdb = setting("PROBE_GDB")
    return gdb if os.path.isabs(gdb) and os.access(gdb, os.X_OK) else shutil.which(gdb)


def _gdb_unavailable(info: ProcessInfo) -> str | None:
    if _gdb_path() is None:
        return (
            f"gdb is not installed (looked for {setting('PROBE_GDB')!r}); install it (apt-get install gdb) or set "
            "PROBE_GDB"
        )
    return ptrace_problem(info.pid) or gdb_cannot_call()


def _canary_key(gdb: str) -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        mtime = os.stat(gdb).st_mtime_ns
    except OSError:
        mtime = 0
    return f"{gdb}|{mtime}|{os.uname().release}|{boot}"


def gdb_cannot_call() -> str | None:
    """Why gdb cannot call a function in a stopped process on this machine, or None when it can.

    Some kernel, CPU and gdb combinations refuse to restore a thread's extended CPU state
    after gdb's inferior call ("Couldn't write extended state status"): the thread then
    resumes with broken registers and the process dies. That must never happen to a
    training job, so the call is first tried on a throw-away ``sleep`` process; the answer
    is kept in the runtime directory for this boot, gdb and kernel.
    """
    gdb = _gdb_path()
    if gdb is None:
        return None
    key = _canary_key(gdb)
    cache = os.path.join(runtime_dir(), "gdb-canary.json")
    try:
        with open(cache) as f:
            known = json.load(f)
        if known.get("key") == key:
            return known.get("why")
    except (OSError, ValueError, AttributeError):
        pass
    why = _run_canary(gdb)
    try:
        tmp = f"{cache}.{os.getpid()}.tmp"
        _private_file(tmp, json.dumps({"key": key, "why": why}).encode())
        os.replace(tmp, cache)
    except OSError:
        pass
    return why


# gdb without the user's gdbinit, auto-loaded scripts or debuginfod downloads: nothing a target's owner controls
_GDB_BATCH = ("-nx", "--batch", "-iex", "set auto-load off", "-iex", "set debuginfod enabled off")


def _run_canary(gdb: str) -> str | None:
    try:
        victim = subprocess.Popen(
            ["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    except OSError:
        return None  # no sleep to try on: go ahead as before
    try:
        proc = subprocess.run(
            [gdb, *_GDB_BATCH, "-p", str(victim.pid), "-ex", 'printf "probe-canary=%d\\n", (int) getpid()'],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        out = proc.stdout + proc.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        out = str(exc)
    finally:
        victim.kill()
        victim.wait()
    if f"probe-canary={victim.pid}" in out:
        return None
    if "ptrace" in out.lower():
        return None  # a ptrace refusal is diagnosed on the real target, with its own exit code
    last = next(
        (line for line in reversed(out.splitlines()) if line.strip() and not line.startswith("[Inferior")), "no output"
    )
    return (
        f"gdb cannot call a function in a stopped process on this machine (tried on a throw-away process: "
        f"{last.rstrip('.')}), and doing so would crash the target"
    )


def _gdb_script(code_file: str) -> str:
    return "\n".join(
        [
            "set pagination off",
            "set confirm off",
            "set scheduler-locking off",
            "set $probe_page = (char *) mmap(0, 65536, 3, 0x22, -1, 0)",  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
            'printf "probe-page=%ld\\n", (long) $probe_page',
            "if (long) $probe_page != -1",
            f"  restore {code_file} binary $probe_page",
            '  printf "probe-pending=%d\\n", (int) Py_AddPendingCall((int (*)(void *)) PyRun_SimpleString, (void *) '
            "$probe_page)",
            "end",
            "detach",
            "quit",
            "",
        ]
    )


def _gdb(info: ProcessInfo, payload: _Payload, timeout: float) -> None:
    if any(c.isspace() or c in "'\"\\" for c in payload.code_file):
        raise AttachError(
            f"the runtime directory {payload.dir} has a space or quote in its path, which gdb cannot take; "
            "set PROBE_RUNTIME_DIR to a plain path.",
            exit_code=EXIT_CODES["tool_failed"],
        )
    script = payload.code_file[:-3] + ".gdb"
    _private_file(script, _gdb_script(payload.code_file).encode())
    argv = [
        _gdb_path(),
        *_GDB_BATCH,
        "-iex",
        "set auto-solib-add off",
        "-p",
        str(info.pid),
        "-ex",
        r"sharedlibrary libc\.so",
        "-ex",
        r"sharedlibrary libpython",
        "-x",
        script,
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        os.kill(info.pid, signal.SIGCONT)  # a killed tracer can leave the target stopped
        raise AttachError(
            f"gdb did not finish with process {info.pid} within {timeout:g} s; retry with a larger --timeout.",
            exit_code=EXIT_CODES["tool_failed"],
        ) from None
    finally:
        os.unlink(script)
    out = proc.stdout + proc.stderr
    if "probe-pending=0" in out:
        return
    why = explain_ptrace_failure(info.pid, out) if "ptrace" in out.lower() else None
    if why:
        raise AttachError(f"gdb could not attach to process {info.pid}: {why}.", exit_code=EXIT_CODES["ptrace_blocked"])
    if "No symbol" in out:
        raise AttachError(
            f"gdb found no Python C-API symbols in process {info.pid} ({info.exe}); its interpreter is "
            "stripped, so use the read-only `probe PID backtrace` instead.",
            exit_code=EXIT_CODES["tool_failed"],
        )
    last = next((line for line in reversed(out.splitlines()) if line.strip()), "no output")
    raise AttachError(
        f"gdb could not schedule the bootstrap in process {info.pid} ({last}); the read-only "
        f"`probe {info.pid} backtrace` still works.",
        exit_code=EXIT_CODES["tool_failed"],
    )


def _existing(pid: int) -> dict | None:
    for entry in read_entries():
        if entry.get("pid") == pid and not entry.get("shared") and os.path.exists(entry.get("socket") or ""):
            return entry
    return None


def _wait_status(payload: _Payload, info: ProcessInfo, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    delay = 0.01
    while time.monotonic() < deadline:
        try:
            with open(payload.status) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
        if not os.path.exists(f"/proc/{info.pid}"):
            raise AttachError(
                f"process {info.pid} exited before the probe started.", exit_code=EXIT_CODES["no_such_pid"]
            )
        time.sleep(delay)  # ok-sleep: polling for the bootstrap's status file with a deadline
        delay = min(delay * 2, 0.2)
    raise AttachError(
        f"process {info.pid} has not run the bootstrap within {timeout:g} s: its main thread has not "
        "reached a bytecode boundary (it may be blocked in a C call or a lock); the probe starts when it "
        f"does, and `probe {info.pid} backtrace` shows where it waits now.",
        exit_code=EXIT_CODES["no_answer"],
    )


def inject(pid: int, *, via: list | None = None, env: dict | None = None, timeout: float = 10.0) -> dict:
    """Start the probe server in ``pid``; return ``{"entry", "via", "already_running", "elapsed"}``."""
    started = time.monotonic()
    try:
        sweep_stale(runtime_dir())  # files of earlier injections whose target died before reading them
    except OSError:
        pass
    info = inspect_process(pid)
    if info.uid != os.geteuid():  # root (or CAP_SYS_PTRACE) may attach, but the bootstrap runs as the target's user
        raise AttachError(
            f"process {pid} belongs to uid {info.uid}, and the probe started inside it would run as that "
            f"user, who cannot read this CLI's private files in {runtime_dir()} (so it would never start, "
            "and inject would only time out); run inject as that user "
            f"(`sudo -u '#{info.uid}' probe inject {pid}`), or read its stacks now with "
            f"`probe {pid} backtrace`.",
            exit_code=EXIT_CODES["other_user"],
        )
    entry = _existing(pid)
    if entry:
        return {"entry": entry, "via": None, "already_running": True, "elapsed": time.monotonic() - started}
    if info.version != cli_version():
        raise AttachError(
            f"process {pid} runs Python {info.version_text} but this probe runs on "
            f"{'%d.%d' % cli_version()}; run the probe installed in the target's environment "
            f"(as the process's owner: {info.exe} -m probe inject {pid}).",
            exit_code=EXIT_CODES["version_mismatch"],
        )
    via = list(via or setting("PROBE_INJECT_VIA", strict=True) or [])
    unknown = [r for r in via if r not in RUNGS]
    if unknown:
        raise AttachError(
            f"unknown injection method {unknown[0]!r}; use {' or '.join(RUNGS)} (PROBE_INJECT_VIA or --via).",
            exit_code=EXIT_CODES["no_rung"],
        )
    reasons, blocked = [], []
    for rung in RUNGS:
        check = _remote_exec_unavailable if rung == "remote_exec" else _gdb_unavailable
        why = check(info) if rung in via else f"{rung} is disabled by PROBE_INJECT_VIA/--via"
        if why:
            reasons.append(why)
            if "ptrace" in why:
                blocked.append(why)
            continue
        payload = _Payload(pid, env or {})
        try:
            if rung == "remote_exec":
                _remote_exec(info, payload)
            else:
                _gdb(info, payload, timeout=max(timeout, 30.0))
        except AttachError:
            payload.discard()
            raise
        try:
            status = _wait_status(payload, info, timeout)
        except AttachError as exc:
            if exc.exit_code == EXIT_CODES["no_such_pid"]:  # the target died first: nobody will read the files
                payload.discard()
            raise  # still waiting: the bootstrap deletes them when it runs
        payload.discard()
        return _outcome(info, status, rung, started)
    code = EXIT_CODES["ptrace_blocked"] if blocked else EXIT_CODES["no_rung"]
    raise AttachError(
        f"cannot inject into process {pid}: {'; '.join(reasons)}; the read-only "
        f"`probe {pid} backtrace` (py-spy) still shows its stacks.",
        exit_code=code,
    )


def _outcome(info: ProcessInfo, status: dict, rung: str, started: float) -> dict:
    if status.get("ok"):
        return {
            "entry": status.get("entry", {}),
            "via": rung,
            "already_running": bool(status.get("already_running")),
            "probe_from": status.get("probe_from"),
            "elapsed": time.monotonic() - started,
        }
    if status.get("reason") == "missing_dependencies":
        missing = ", ".join(status.get("missing", []))
        raise AttachError(
            f"process {info.pid} cannot import {missing}, which the probe needs; install them in the "
            f"target's environment ({status.get('executable')} -m pip install {missing.replace(',', '')}).",
            exit_code=EXIT_CODES["bootstrap_failed"],
        )
    raise AttachError(
        f"the probe failed to start inside process {info.pid} ({status.get('error')}); start the job "
        "with `import probe.auto` instead.",
        exit_code=EXIT_CODES["bootstrap_failed"],
    )
