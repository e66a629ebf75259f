"""The REPL's backslash commands, in a registry; ``\\?`` is generated from it.

Each handler is ``fn(repl, arg)`` where ``arg`` is the rest of the line. Commands
that exist as CLI commands (backtrace, tables, describe, eval, lr, checkpoint,
cleanup) run the registered CLI command class against the current target, so the
REPL and the command line behave the same.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from typing import Callable

from probe._errors import ProbeError

__all__ = ["Special", "SPECIALS", "special_command", "help_text", "dispatch", "Quit"]


class Quit(Exception):
    """Leave the REPL."""


@dataclass(frozen=True)
class Special:
    name: str
    args: str
    help: str
    fn: Callable


SPECIALS: dict[str, Special] = {}


def special_command(name: str, args: str, help: str, aliases: tuple[str, ...] = ()):
    """Register ``fn(repl, arg)`` as the backslash command ``name`` (with ``aliases``)."""

    def register(fn):
        SPECIALS[name] = Special(name, args, help, fn)
        for a in aliases:
            SPECIALS[a] = Special(a, args, f"Same as {name}.", fn)
        return fn

    return register


def help_text() -> str:
    rows = [(f"{s.name} {s.args}".strip(), s.help) for s in SPECIALS.values() if not s.help.startswith("Same as")]
    width = max(len(r[0]) for r in rows)
    lines = [
        "SQL statements end with ';' (Enter inside one starts a new line). Tab completes tables, columns, functions."
    ]
    lines += [f"  {a.ljust(width)}  {h}" for a, h in rows]
    lines.append("Ctrl-C cancels a running query (in the target too); Ctrl-D leaves.")
    return "\n".join(lines)


def dispatch(repl, line: str) -> None:
    """Run one backslash command line."""
    name, _, arg = line.strip().partition(" ")
    spec = SPECIALS.get(name)
    if spec is None:
        raise ProbeError(f"unknown command {name}; \\? lists the commands.")
    spec.fn(repl, arg.strip())


def _split(arg: str) -> list[str]:
    try:
        return shlex.split(arg)
    except ValueError as exc:
        raise ProbeError(f"could not read the arguments ({exc}); check the quotes.") from None


@special_command("\\?", "", "Show this help.", aliases=("\\h", "help"))
def _help(repl, arg):
    repl.print(help_text())


@special_command("\\q", "", "Leave the REPL (Ctrl-D does the same).", aliases=("quit", "exit"))
def _quit(repl, arg):
    raise Quit()


@special_command("\\dt", "", "List the tables of the target with their descriptions.")
def _tables(repl, arg):
    repl.session.run_command("tables", [])


@special_command("\\d", "TABLE", "Show the columns of TABLE with types and descriptions.")
def _describe(repl, arg):
    if not arg:
        raise ProbeError("\\d needs a table name, e.g. \\d python.backtrace (\\dt lists them).")
    repl.session.run_command("describe", [arg])


@special_command("\\bt", "[THREAD]", "Backtrace of every thread (or of THREAD), innermost frame first.")
def _backtrace(repl, arg):
    repl.session.run_command("backtrace", ["--thread", arg] if arg else [])


@special_command("\\x", "", "Toggle expanded output (one column per line).")
def _expanded(repl, arg):
    repl.session.expanded = not repl.session.expanded
    repl.print(f"Expanded display is {'on' if repl.session.expanded else 'off'}.")


@special_command("\\format", "table|json|csv", "Set the output format.")
def _format(repl, arg):
    if arg not in ("table", "json", "csv"):
        raise ProbeError(f"unknown format {arg!r}; use \\format table, \\format json or \\format csv.")
    repl.session.format = arg
    repl.print(f"Output format is {arg}.")


@special_command("\\timing", "", "Toggle printing the row count and time of each query.")
def _timing(repl, arg):
    repl.session.timing = not repl.session.timing
    repl.print(f"Timing is {'on' if repl.session.timing else 'off'}.")


@special_command("\\rank", "N", "Switch to rank N (from the registry); the prompt shows it.")
def _rank(repl, arg):
    try:
        rank = int(arg)
    except ValueError:
        raise ProbeError(f"\\rank takes a rank number, e.g. \\rank 3, not {arg!r}.") from None
    repl.switch(("rank", rank))


@special_command("\\ranks", "SPEC", "Query several ranks at once: all, 0-3, 0-3,7 (results get a rank column).")
def _ranks(repl, arg):
    repl.switch(("ranks", arg or "all"))


@special_command("\\connect", "ENDPOINT", "Switch to another process: a pid, host:port or socket path.")
def _connect(repl, arg):
    if not arg:
        raise ProbeError("\\connect needs an endpoint: a pid, host:port or socket path (see `probe list`).")
    repl.switch(("endpoint", arg))


@special_command("\\reconnect", "", "Connect again to the same endpoint or rank (a restarted rank is found anew).")
def _reconnect(repl, arg):
    repl.switch(repl.session.spec)


@special_command("\\eval", "CODE", "Run Python CODE in the target (eval tier; audit-logged).")
def _eval(repl, arg):
    if not arg:
        raise ProbeError("\\eval needs Python code, e.g. \\eval print(optimizer.param_groups[0]['lr']).")
    repl.session.run_command("eval", [arg])


@special_command(
    "\\lr", "OPTIONS", "Change the learning rate at the next step, e.g. \\lr --scale 0.1 (same options as `probe lr`)."
)
def _lr(repl, arg):
    repl.session.run_command("lr", _split(arg))


@special_command("\\checkpoint", "PATH", "Save weights, optimizer, scheduler, step and RNG at the next step boundary.")
def _checkpoint(repl, arg):
    repl.session.run_command("checkpoint", _split(arg))


@special_command("\\cleanup", "", "Collect garbage and empty the CUDA cache at a safe point.")
def _cleanup(repl, arg):
    repl.session.run_command("cleanup", _split(arg))


@special_command("\\watch", "N SQL", "Run SQL every N seconds until Ctrl-C.")
def _watch(repl, arg):
    every, _, sql = arg.partition(" ")
    try:
        seconds = float(every)
        if seconds <= 0:
            raise ValueError
    except ValueError:
        raise ProbeError(
            "\\watch takes a number of seconds and a query, e.g. \\watch 2 SELECT MAX(step) FROM torch.steps."
        ) from None
    sql = sql.strip().rstrip(";").strip()
    if not sql:
        raise ProbeError("\\watch needs a query after the seconds, e.g. \\watch 2 SELECT * FROM process.info.")
    try:
        while True:
            repl.print(f"-- every {seconds:g} s: {sql}  ({time.strftime('%H:%M:%S')}; Ctrl-C stops)")
            if not repl.run_sql(sql):
                return
            time.sleep(seconds)  # ok-sleep: the user asked for this interval
    except KeyboardInterrupt:
        repl.print("Stopped watching.")
