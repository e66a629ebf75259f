"""Settings read from the environment, declared once with their type and documentation.

Every setting is parsed here and only here: ``setting(name)`` returns the typed value
(``int``, ``float``, a tri-state flag, a list of names, or a mode such as PROBE_TRACE's
``all``/``off``/N). A value that does not parse gives one sentence saying what was
expected: ``strict=True`` (the CLI) raises it as a ProbeError; otherwise (inside the
training process, where nothing may raise) it is recorded in ``probe.errors`` and the
default is used. docs/reference.md's settings are generated from ``SETTINGS`` (and a
test checks it), so a setting cannot exist undocumented.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from ._errors import ProbeError


class Setting:
    """A declared environment setting (a plain class: the CLI imports this at start-up)."""

    __slots__ = ("name", "default", "help", "parse")

    def __init__(self, name: str, default: str | None, help: str, parse: Callable[[str], Any]):
        self.name, self.default, self.help, self.parse = name, default, help, parse

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, {self.default!r})"


SETTINGS: dict[str, Setting] = {}


def _declare(name: str, default: str | None, help: str, parse: Callable[[str], Any] | None = None) -> None:
    SETTINGS[name] = Setting(name, default, help, parse or str)


# -- parsers: each takes the raw text and returns the value, or raises ValueError("expected ...") --


def _number(kind=float, minimum: float | None = None, above: float | None = None, what: str = "a number"):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(what) from None
        if (
            (isinstance(value, float) and not math.isfinite(value))
            or (minimum is not None and value < minimum)
            or (above is not None and value <= above)
        ):
            raise ValueError(what)
        return value

    return parse


_SECONDS = _number(float, above=0, what="a positive number of seconds")
_COUNT = _number(int, minimum=1, what="a whole number of at least 1")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(text: str) -> bool:
    v = text.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ValueError("1 or 0 (true/false, yes/no, on/off)")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _every(text: str) -> int:
    """PROBE_TRACE: 'all' -> 1 (every step), 'off' -> 0, N -> one step in N."""
    v = text.strip().lower()
    if v in ("all", "on"):
        return 1
    if v in ("off", "no", "false", "none"):
        return 0
    return _number(int, minimum=0, what="all, off or a whole number N (one step in N)")(v)


def _share(text: str) -> float:
    """PROBE_GRAD_NORM: 'all' -> inf (every step), 'off' -> 0, else a share of step time."""
    v = text.strip().lower()
    if v in ("all", "on", "every"):
        return math.inf
    if v in ("off", "no", "none", "false"):
        return 0.0
    return _number(float, minimum=0, what="all, off or a share of step time such as 0.001")(v)


_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def _limit(of: str):
    """A share of ``of`` in (0, 1], or 'off' (no limit) -> inf: PROBE_STEP_BUDGET, PROBE_SERVE_SHARE."""
    what = f"off or a share of {of} above 0 and at most 1, such as 0.01"

    def parse(text: str) -> float:
        v = text.strip().lower()
        if v in ("off", "no", "none", "false", "all"):
            return math.inf
        share = _number(float, above=0, what=what)(v)
        if share > 1:
            raise ValueError(what)
        return share

    return parse


_budget = _limit("step time")


def _size(text: str) -> int:
    """A size in bytes: ``64MB``, ``512KiB``, ``1000000``.

    >>> _size("2MiB"), _size("64MB")
    (2097152, 64000000)
    """
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError("a size such as 64MB, 512KiB or a number of bytes")
    return max(1, int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]))


def _seconds_or_off(text: str) -> float | None:
    """A number of seconds; 0 or less turns the feature off (None)."""
    value = _number(float, what="a number of seconds")(text)
    return value if value > 0 else None


def _probe_mode(text: str) -> str | None:
    """PROBE: 1/workers -> 'workers', 'all' -> 'all', 0/off -> None."""
    v = text.strip().lower()
    if v in ("workers", "all"):
        return v
    try:
        return "workers" if _flag(v) else None
    except ValueError:
        raise ValueError("1 (or workers), all, or 0") from None


_declare(
    "PROBE",
    None,
    "Start the probe at interpreter start-up with no code change. 1 (or workers): in the launcher's worker processes, "
    "not in launchers (torchrun), pip, multiprocessing helpers, or processes started by an already probed process "
    "(compile workers, data subprocesses); all: also in those subprocesses; 0: off.",
    _probe_mode,
)
_declare(
    "PROBE_ONLY",
    None,
    "With PROBE set: start the probe only in processes whose script name or -m module matches one of these "
    "comma-separated shell patterns (e.g. train*.py,my_pkg.train), wherever they are in the launch tree.",
    _names,
)
_declare(
    "PROBE_RUNTIME_DIR",
    None,
    "Directory for sockets, registry entries, audit log and hang dumps; default $XDG_RUNTIME_DIR/probe or "
    "/tmp/probe-$UID.",
)
_declare(
    "PROBE_PORT",
    None,
    "Also listen on this TCP port (0 picks a free one); requires a token.",
    _number(int, minimum=0, what="a TCP port number (0 picks a free one)"),
)
_declare("PROBE_HOST", "127.0.0.1", "Address the TCP listener binds; a non-loopback address is logged loudly at start.")
_declare(
    "PROBE_TOKEN",
    None,
    "The job's token, from which each rank's TCP key is derived (clients prove requests with it, never send it); "
    "generated when unset, and each rank's key stored in its 0600 registry entry.",
)
_declare(
    "PROBE_MCP_TOKEN",
    None,
    "Bearer token clients of `probe mcp --http` must send (at least 16 characters); generated and printed at start "
    "when unset. Not PROBE_TOKEN, which opens the training processes themselves.",
)
_declare(
    "PROBE_ALLOW_EVAL",
    None,
    "1 allows eval and debug over TCP (with the token); 0 disables both everywhere; unset allows them on the unix "
    "socket only.",
    _flag,
)
_declare(
    "PROBE_ACTION_TIMEOUT",
    "60",
    "Seconds a queued action (checkpoint, lr, cleanup, eval --at-step) waits for a step boundary before it is dropped "
    "as timed_out, when the client gives no --timeout.",
    _SECONDS,
)
_declare(
    "PROBE_GUARD",
    None,
    "Arm the guard from the start (at the first step boundary), as `probe guard` would: comma-separated triggers "
    "(nonfinite, spike=N, loss=N) and keep=N, skip, rollback, evidence=DIR, e.g. "
    "'nonfinite,spike=50,keep=1,skip,evidence=/tmp/guard' (docs/guard.md).",
)
_declare(
    "PROBE_QUERY_TIMEOUT",
    "10",
    "Seconds a query may run (snapshot, then DuckDB in the client) before it is stopped; clients pass --timeout.",
    _SECONDS,
)
_declare(
    "PROBE_QUERY_MEMORY",
    "256MB",
    "DuckDB memory limit of the client's query engine (DuckDB never runs in the training process).",
)
_declare("PROBE_MAX_ROWS", "10000", "Default row cap of a query result; a client can ask for more.", _COUNT)
_declare(
    "PROBE_SNAPSHOT_BYTES",
    "64MB",
    "Training process: largest table snapshot (the columns one query needs, after its pushed-down filters) it hands to "
    "a client; larger ones are refused with a hint.",
    _size,
)
_declare(
    "PROBE_SERVE_SHARE",
    "0.02",
    "Training process: share of wall time its snapshots, backtraces and profiles may take, averaged over ten seconds, "
    "for each listener (the unix socket and TCP apart, so that TCP clients cannot spend the owner's); each request is "
    "charged its thread's whole CPU time (filters, every table it names, every stack, encoding), and the next waits "
    "until that is earned back, up to its timeout, so that no client, whatever it sends, can slow training more; "
    "'off' serves them as fast as they come.",
    _limit("wall time"),
)
_declare(
    "PROBE_MAX_SNAPSHOTS",
    "2",
    "Training process: snapshots and backtraces taken at the same time, for each listener (the unix socket and TCP "
    "apart); further ones wait in line up to their timeout.",
    _COUNT,
)
_declare(
    "PROBE_MAX_CONNECTIONS",
    "32",
    "Training process: open client connections served at once, unix socket and TCP each; more are closed at once with "
    "a 503.",
    _number(int, minimum=2, what="a whole number of at least 2"),
)
_declare(
    "PROBE_READ_TIMEOUT",
    "5",
    "Training process: seconds a client may take to send its request line and headers, in all (a byte now and then "
    "does not keep a connection), then per read of its body, before the connection is closed.",
    _SECONDS,
)
_declare(
    "PROBE_REGISTRY",
    None,
    "Shared directory (e.g. on a network file system) where every rank also writes its registry entry, for discovery "
    "across nodes.",
)
_declare(
    "PROBE_TRACE",
    None,
    "Module tracing: 'all' traces every step, 'off' disables it, a number N traces one step in N (default chosen to "
    "keep overhead under 1%).",
    _every,
)
_declare(
    "PROBE_TRACE_STATS",
    "1",
    "On traced steps, also reduce each module's output on its device (mean, std, std across the batch, zeros, "
    "non-finite values: the out_* columns of python.torch_trace); 0 records times and memory only.",
    _flag,
)
_declare(
    "PROBE_TRACE_SYNCS",
    "1",
    "On traced steps of a CUDA job, turn torch's sync debug mode to warn and count the host-device syncs by call site "
    "(torch.syncs); 0 leaves the mode alone.",
    _flag,
)
_declare("PROBE_TRACE_CAPACITY", "100000", "Rows kept in the python.torch_trace ring buffer.", _COUNT)
_declare(
    "PROBE_SPANS_CAPACITY",
    "10000",
    "Rows kept in the python.spans ring buffer (spans recorded with probe.span).",
    _COUNT,
)
_declare("PROBE_STEPS_CAPACITY", "10000", "Rows kept in the torch.steps ring buffer.", _COUNT)
_declare(
    "PROBE_GRAD_NORM",
    "0.001",
    "Share of step time the probe's own gradient-norm computation may take (it runs on every N-th step to fit); 'all' "
    "computes it every step, 'off' never. A loop that calls clip_grad_norm_ gets its norm on every step for free.",
    _share,
)
_declare(
    "PROBE_STEP_BUDGET",
    "0.01",
    "Share of step time the probe's own per-step work may take (measured as it goes): the loss read-back, grad norm, "
    "peak memory, discovery scans and module-trace scheduling run on the steps that fit (torch.steps.measured), while "
    "step count, step time, lr and actions stay exact on every step; 'off' measures every step.",
    _budget,
)
_declare(
    "PROBE_LOSS_NAMES",
    "loss",
    "Comma-separated names of the scalar loss tensor looked up in the training loop's frames at each step.",
    _names,
)
_declare(
    "PROBE_HANG_TIMEOUT",
    None,
    "Seconds without a completed step after which every thread's stack is written to the runtime directory.",
    _seconds_or_off,
)
_declare(
    "PROBE_POSTMORTEM_EVERY",
    "30",
    "Seconds between the periodic post-mortem snapshots of the tables (written off the training thread, only after new "
    "steps), so a process killed with SIGKILL still leaves its last minute; 0 turns them off.",
    _seconds_or_off,
)
_declare("PROBE_POSTMORTEM_ROWS", "2000", "Rows of each table a post-mortem record keeps (the newest).", _COUNT)
_declare(
    "PROBE_POSTMORTEM_KEEP",
    "20",
    "Post-mortem records kept in the runtime directory; the oldest are removed when a new one is written.",
    _COUNT,
)
_declare(
    "PROBE_INJECT_VIA",
    "remote_exec,gdb",
    "Injection methods `probe inject` may use, in order: remote_exec (Python 3.14+), gdb.",
    _names,
)
_declare("PROBE_GDB", "gdb", "The gdb executable `probe inject` runs (a name on PATH or an absolute path).")
_declare(
    "PROBE_STRAGGLER_FACTOR",
    "1.5",
    "For --ranks: a rank is a straggler (ranks.stragglers, `status` state slow) when its median compute time per step "
    "(step time minus the time it waits for other ranks, from the flight recorder; its step time without one) exceeds "
    "the other ranks' median by this factor.",
    _number(float, above=1.0, what="a factor above 1, such as 1.5"),
)
_declare(
    "PROBE_HUNG_AFTER",
    "60",
    "For --ranks: seconds without a completed step after which ranks.hung and `status` call a rank hung (or waiting, "
    "inside a collective).",
    _SECONDS,
)
_declare(
    "PROBE_COLLECTIVES",
    "500",
    "Entries of torch's c10d flight recorder (torch.collectives) turned on when the probe starts before the first "
    "process group and TORCH_FR_BUFFER_SIZE is unset; 0 or off leaves it off.",
    lambda text: (
        0
        if text.strip().lower() in _FALSE + ("none",)
        else _number(int, minimum=0, what="a number of entries, or off")(text)
    ),
)
_declare(
    "PROBE_DESYNC_STEPS",
    "1",
    "For --ranks: ranks.desync lists ranks more than this many steps behind the most advanced one.",
    _number(float, minimum=0, what="a number of steps, 0 or more"),
)


def setting(name: str, environ: dict | None = None, *, strict: bool = False):
    """The typed value of a declared setting: the environment's, else its default's.

    An unparsable value is a ProbeError with strict (the CLI), else it is recorded in
    ``probe.errors`` and the default is used instead (the training process).
    """
    decl = SETTINGS[name]
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None if decl.default is None else decl.parse(decl.default)
    try:
        return decl.parse(raw)
    except ValueError as exc:
        err = ProbeError(
            f"{name}={raw!r} is not valid: expected {exc}; fix or unset it"
            + (f" (default {decl.default})." if decl.default is not None else ".")
        )
        if strict:
            raise err from None
        from .util.errorlog import record_error

        record_error(name, err)
        return None if decl.default is None else decl.parse(decl.default)
