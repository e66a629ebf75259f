"""Settings read from the environment, declared once with their type and documentation.

Every setting is parsed here and only here: ``setting(name)`` returns the typed value
(``int``, ``float``, a tri-state flag, a list of names, or a mode such as PROBE_TRACE's
``all``/``off``/N). A value that does not parse gives one sentence saying what was
expected: ``strict=True`` (the CLI) raises it as a ProbeError; otherwise (inside the
training process, where nothing may raise) it is recorded in ``probe.errors`` and the
default is used. The README's settings reference is generated from ``SETTINGS`` (and a
test checks it), so a setting cannot exist undocumented.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from ._errors import ProbeError

__all__ = ["Setting", "SETTINGS", "setting"]


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
        if (isinstance(value, float) and not math.isfinite(value)) or (minimum is not None and value < minimum) \
                or (above is not None and value <= above):
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


def _seconds_or_off(text: str) -> float | None:
    """A number of seconds; 0 or less turns the feature off (None)."""
    value = _number(float, what="a number of seconds")(text)
    return value if value > 0 else None


_declare("PROBE", None, "Set to 1 to start the probe in any Python process at interpreter start-up, with no code change.", _flag)
_declare("PROBE_RUNTIME_DIR", None, "Directory for sockets, registry entries, audit log and hang dumps; default $XDG_RUNTIME_DIR/probe or /tmp/probe-$UID.")
_declare("PROBE_PORT", None, "Also listen on this TCP port (0 picks a free one); requires a token.",
         _number(int, minimum=0, what="a TCP port number (0 picks a free one)"))
_declare("PROBE_HOST", "127.0.0.1", "Address the TCP listener binds; a non-loopback address is logged loudly at start.")
_declare("PROBE_TOKEN", None, "Token TCP clients must send; generated and stored in the 0600 registry entry when unset.")
_declare("PROBE_ALLOW_EVAL", None, "1 allows eval over TCP (with the token); 0 disables eval everywhere; unset allows it on the unix socket only.", _flag)
_declare("PROBE_ACTION_TIMEOUT", "60", "Seconds a queued action (checkpoint, lr, cleanup, eval --at-step) waits for a step boundary before it is dropped as timed_out, when the client gives no --timeout.", _SECONDS)
_declare("PROBE_QUERY_TIMEOUT", "10", "Seconds a query may run before DuckDB is interrupted.", _SECONDS)
_declare("PROBE_QUERY_MEMORY", "256MB", "DuckDB memory limit for queries (one database serves them all: queries running at the same time share it).")
_declare("PROBE_MAX_ROWS", "10000", "Default row cap of a query result; a client can ask for more.", _COUNT)
_declare("PROBE_REGISTRY", None, "Shared directory (e.g. on a network file system) where every rank also writes its registry entry, for discovery across nodes.")
_declare("PROBE_TRACE", None, "Module tracing: 'all' traces every step, 'off' disables it, a number N traces one step in N (default chosen to keep overhead under 1%).", _every)
_declare("PROBE_TRACE_CAPACITY", "100000", "Rows kept in the python.torch_trace ring buffer.", _COUNT)
_declare("PROBE_STEPS_CAPACITY", "10000", "Rows kept in the torch.steps ring buffer.", _COUNT)
_declare("PROBE_GRAD_NORM", "0.001", "Share of step time the probe's own gradient-norm computation may take (it runs on every N-th step to fit); 'all' computes it every step, 'off' never. A loop that calls clip_grad_norm_ gets its norm on every step for free.", _share)
_declare("PROBE_LOSS_NAMES", "loss", "Comma-separated names of the scalar loss tensor looked up in the training loop's frames at each step.", _names)
_declare("PROBE_HANG_TIMEOUT", None, "Seconds without a completed step after which every thread's stack is written to the runtime directory.", _seconds_or_off)
_declare("PROBE_POSTMORTEM_EVERY", "30", "Seconds between the periodic post-mortem snapshots of the tables (written off the training thread, only after new steps), so a process killed with SIGKILL still leaves its last minute; 0 turns them off.", _seconds_or_off)
_declare("PROBE_POSTMORTEM_ROWS", "2000", "Rows of each table a post-mortem record keeps (the newest).", _COUNT)
_declare("PROBE_POSTMORTEM_KEEP", "20", "Post-mortem records kept in the runtime directory; the oldest are removed when a new one is written.", _COUNT)
_declare("PROBE_INJECT_VIA", "remote_exec,gdb", "Injection methods `probe inject` may use, in order: remote_exec (Python 3.14+), gdb.", _names)
_declare("PROBE_GDB", "gdb", "The gdb executable `probe inject` runs (a name on PATH or an absolute path).")
_declare("PROBE_STRAGGLER_FACTOR", "1.5", "For --ranks: a rank is a straggler (ranks.stragglers, `status` state slow) when its median step time exceeds the others' median by this factor.",
         _number(float, above=1.0, what="a factor above 1, such as 1.5"))
_declare("PROBE_HUNG_AFTER", "60", "For --ranks: seconds without a completed step after which ranks.hung and `status` call a rank hung (or waiting, inside a collective).", _SECONDS)
_declare("PROBE_DESYNC_STEPS", "1", "For --ranks: ranks.desync lists ranks more than this many steps behind the most advanced one.",
         _number(float, minimum=0, what="a number of steps, 0 or more"))


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
        err = ProbeError(f"{name}={raw!r} is not valid: expected {exc}; fix or unset it"
                         + (f" (default {decl.default})." if decl.default is not None else "."))
        if strict:
            raise err from None
        from .util.errorlog import record_error

        record_error(name, err)
        return None if decl.default is None else decl.parse(decl.default)
