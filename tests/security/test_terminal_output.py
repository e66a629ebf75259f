"""What a process chose reaches the user's terminal escaped: thread, function and file names, table cells,
argv, exception messages, in every human format (table, expanded, csv, backtrace, error lines, the REPL),
while JSON stays exact. The target (tests/targets/hostile_names.py) carries an OSC 52 clipboard write,
cursor moves, a C1 CSI and a bidi override in each of them."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import TARGETS, run_target

HOSTILE = TARGETS / "hostile_names.py"
ESCAPES = "\x1b]52;c;SGVsbG8=\x07\x1b[1A\x1b[2K\x9b2J\u202e"  # what the target puts in its names
SHOWN = r"\x1b]52;c;SGVsbG8=\x07\x1b[1A\x1b[2K\x9b2J\u202e"  # the same, as the terminal must show it
WIDE = {"COLUMNS": "400"}  # tables as wide as their cells: nothing cut with '…'
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def assert_escaped(r, *, shown: str = SHOWN, where: str = "stdout") -> None:
    text = r.stdout + r.stderr
    assert not [c for c in RAW if c in text], (r.args, text)
    assert shown in getattr(r, where), (r.args, text)


@pytest.fixture
def hostile(spawn):
    # the escapes reach the process also in its command line (an -X option, within the 80 characters `probe list`
    # shows) and an environment variable
    proc = spawn([sys.executable, "-X", f"arg{ESCAPES}", HOSTILE], env={"EVIL": f"v{ESCAPES}"})
    yield proc
    assert proc.popen.poll() is None and "Traceback" not in proc.output(), proc.output()[-2000:]


def test_names_cells_and_messages_from_the_process_are_escaped_in_every_human_format(hostile, cli, probe_env):
    pid = str(hostile.pid)
    # when every command that shows the process's text runs against it
    for args in (
        ["backtrace"],
        ["backtrace", "--locals"],
        ["status"],
        ["query", "SELECT name FROM python.threads"],
        ["query", "SELECT value FROM process.env WHERE name = 'EVIL'"],
        ["query", "-f", "csv", "SELECT name FROM python.threads"],
        ["query", "-x", "SELECT name FROM python.threads"],
    ):
        r = cli(pid, *args, env=WIDE)
        # then it succeeds, and shows each escape as text, never as the byte a terminal obeys
        assert r.returncode == 0, (args, r.stderr)
        assert_escaped(r)
    # a frame's function and file name, in the backtrace
    bt = cli(pid, "backtrace").stdout
    assert f"nap{SHOWN} ({SHOWN}evil.py:2)" in bt and f'"named{SHOWN}"' in bt, bt
    # a newline in a thread name cannot start a line of its own
    assert "evil\\nrm -rf ~" in bt and "\nrm -rf" not in bt, bt
    # the process's argv, in `probe list`
    assert_escaped(cli("list", env=WIDE), shown=f"arg{SHOWN}")
    # an exception message, on the error line and in the traceback shown
    r = cli(pid, "eval", "explain()")
    assert r.returncode != 0
    assert_escaped(r, shown=f"told{SHOWN}you", where="stderr")
    assert f"probe: action 1 (eval) failed: the code raised RuntimeError: told{SHOWN}you" in r.stderr, r.stderr
    # the REPL, reading its statements from a pipe
    statements = "SELECT name FROM python.threads;\nSELECT value FROM process.env WHERE name = 'EVIL';\n"
    r = cli(pid, env=WIDE, input=statements)
    assert r.returncode == 0, r.stderr
    assert_escaped(r)
    # and JSON stays exact: the same strings, decoded, are the process's own
    doc = json.loads(cli(pid, "--format", "json", "query", "SELECT name FROM python.threads").stdout)
    assert f"named{ESCAPES}" in [row["name"] for row in doc]


def test_a_dead_process_exception_is_escaped_in_list_dead(cli, probe_env):
    # given a process that died of an exception whose message carries the escapes
    done = run_target([HOSTILE, "--die"], probe_env)
    assert done.returncode != 0 and "RuntimeError" in done.stderr, done.stderr
    # when its post-mortem records are listed
    r = cli("list", "--dead", env=WIDE)
    # then the message is shown escaped
    assert r.returncode == 0, r.stderr
    assert_escaped(r, shown="RuntimeError: told\\x1b]52;c;")
