"""Settings read from the environment, declared once with their documentation.

The README's settings reference is generated from ``SETTINGS`` (and a test checks it),
so a setting cannot exist undocumented.
"""

from __future__ import annotations

import os

__all__ = ["Setting", "SETTINGS", "setting", "env_flag"]


class Setting:
    """A declared environment setting (a plain class: the CLI imports this at start-up)."""

    __slots__ = ("name", "default", "help")

    def __init__(self, name: str, default: str | None, help: str):
        self.name, self.default, self.help = name, default, help

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, {self.default!r})"


SETTINGS: dict[str, Setting] = {}


def _declare(name: str, default: str | None, help: str) -> None:
    SETTINGS[name] = Setting(name, default, help)


_declare("PROBE", None, "Set to 1 to start the probe in any Python process at interpreter start-up, with no code change.")
_declare("PROBE_RUNTIME_DIR", None, "Directory for sockets, registry entries, audit log and hang dumps; default $XDG_RUNTIME_DIR/probe or /tmp/probe-$UID.")
_declare("PROBE_PORT", None, "Also listen on this TCP port (0 picks a free one); requires a token.")
_declare("PROBE_HOST", "127.0.0.1", "Address the TCP listener binds; a non-loopback address is logged loudly at start.")
_declare("PROBE_TOKEN", None, "Token TCP clients must send; generated and stored in the 0600 registry entry when unset.")
_declare("PROBE_ALLOW_EVAL", None, "1 allows eval over TCP (with the token); 0 disables eval everywhere; unset allows it on the unix socket only.")
_declare("PROBE_ACTION_TIMEOUT", "60", "Seconds a queued action (checkpoint, lr, cleanup, eval --at-step) waits for a step boundary before it is dropped as timed_out, when the client gives no --timeout.")
_declare("PROBE_QUERY_TIMEOUT", "10", "Seconds a query may run before DuckDB is interrupted.")
_declare("PROBE_QUERY_MEMORY", "256MB", "DuckDB memory limit for queries (one database serves them all: queries running at the same time share it).")
_declare("PROBE_MAX_ROWS", "10000", "Default row cap of a query result; a client can ask for more.")
_declare("PROBE_REGISTRY", None, "Shared directory (e.g. on a network file system) where every rank also writes its registry entry, for discovery across nodes.")
_declare("PROBE_TRACE", None, "Module tracing: 'all' traces every step, 'off' disables it, a number N traces one step in N (default chosen to keep overhead under 1%).")
_declare("PROBE_TRACE_CAPACITY", "100000", "Rows kept in the python.torch_trace ring buffer.")
_declare("PROBE_STEPS_CAPACITY", "10000", "Rows kept in the torch.steps ring buffer.")
_declare("PROBE_GRAD_NORM", "0.001", "Share of step time the probe's own gradient-norm computation may take (it runs on every N-th step to fit); 'all' computes it every step, 'off' never. A loop that calls clip_grad_norm_ gets its norm on every step for free.")
_declare("PROBE_LOSS_NAMES", "loss", "Comma-separated names of the scalar loss tensor looked up in the training loop's frames at each step.")
_declare("PROBE_HANG_TIMEOUT", None, "Seconds without a completed step after which every thread's stack is written to the runtime directory.")
_declare("PROBE_INJECT_VIA", "remote_exec,gdb", "Injection methods `probe inject` may use, in order: remote_exec (Python 3.14+), gdb.")
_declare("PROBE_GDB", "gdb", "The gdb executable `probe inject` runs (a name on PATH or an absolute path).")
_declare("PROBE_STRAGGLER_FACTOR", "1.5", "For --ranks: a rank is a straggler (ranks.stragglers, `status` state slow) when its median compute time per step (torch.steps.compute; its step time without flight-recorder timings) exceeds the other ranks' median by this factor.")
_declare("PROBE_HUNG_AFTER", "60", "For --ranks: seconds without a completed step after which ranks.hung and `status` call a rank hung (or waiting, inside a collective).")
_declare("PROBE_COLLECTIVES", "500", "Entries of torch's c10d flight recorder (torch.collectives) turned on when the probe starts before the first process group and TORCH_FR_BUFFER_SIZE is unset; 0 or off leaves it off.")
_declare("PROBE_DESYNC_STEPS", "1", "For --ranks: ranks.desync lists ranks more than this many steps behind the most advanced one.")


def setting(name: str, environ: dict | None = None) -> str | None:
    """The value of a declared setting: the environment, else its default."""
    decl = SETTINGS[name]
    env = os.environ if environ is None else environ
    value = env.get(name)
    return decl.default if value in (None, "") else value


def env_flag(name: str) -> bool | None:
    """A tri-state flag: True for 1/true/yes/on, False for 0/false/no/off, None when unset."""
    value = setting(name)
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")
