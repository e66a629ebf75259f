"""The REPL end to end through a pseudo-terminal, against real target processes.

prompt-toolkit redraws with escape sequences, so the assertions look for plain
substrings that a redraw prints whole (result rows, messages), never for screens.
"""

from __future__ import annotations

import os
import termios
import time

import pytest

from conftest import EXAMPLES, PROBE_BIN, TARGETS, poll, requires_torch

pexpect = pytest.importorskip("pexpect")

PROMPT = r"probe pid \d+>"
LONG_QUERY = "SELECT count(*) FROM range(1000000000) a, range(1000000) b WHERE a.range + b.range < 0;"


@pytest.fixture
def repl(probe_env, tmp_path):
    """Start `probe ENDPOINT` in a pty; yields a function that opens it on a pid."""
    children = []

    def _open(pid: int, *extra: str, cpr: bool = False):
        # Without cursor-position reports prompt-toolkit hides the bottom toolbar; tests that
        # look at the toolbar answer the reports themselves (see _expect_answering_cpr).
        env = dict(probe_env, TERM="xterm", XDG_STATE_HOME=str(tmp_path / "state"), COLUMNS="160", LINES="40")
        if not cpr:
            env["PROMPT_TOOLKIT_NO_CPR"] = "1"
        child = pexpect.spawn(
            PROBE_BIN,
            [*extra, str(pid)],
            env=env,
            dimensions=(40, 160),
            encoding="utf-8",
            timeout=20,
            cwd=str(tmp_path),
        )
        child.logfile_read = open(tmp_path / "pty.log", "w")
        children.append(child)
        child.expect("probe SQL on")
        if not cpr:
            child.expect(PROMPT)
        return child

    yield _open
    for child in children:
        if child.isalive():
            child.sendcontrol("d")
            try:
                child.expect(pexpect.EOF, timeout=5)
            except pexpect.TIMEOUT:
                child.terminate(force=True)


def _expect_answering_cpr(child, pattern, timeout=15.0):
    """Expect ``pattern`` while answering prompt-toolkit's cursor-position requests (ESC [6n)."""
    end = time.monotonic() + timeout
    while True:
        if child.expect([r"\x1b\[6n", pattern], timeout=max(0.1, end - time.monotonic())) == 0:
            child.send("\x1b[40;1R")
            continue
        return child.match


def _wait_completion_ready(child, deadline=10.0):
    """Wait until the background refresh has loaded the schema: Tab on `\\d python.th` completes."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        child.send("\\d python.thr\t")
        try:
            child.expect("python.threads", timeout=1.0)
            child.sendcontrol("c")
            child.expect(PROMPT)
            return
        except pexpect.TIMEOUT:
            child.sendcontrol("c")
            child.expect(PROMPT)
    raise AssertionError("the completion schema never loaded")


def test_query_special_error_and_completion(spawn, repl):
    # given a plain probed process and a REPL on it
    target = spawn(TARGETS / "idle.py")
    child = repl(target.pid)
    # when a query runs, its rows print
    child.sendline("SELECT name FROM python.threads ORDER BY name;")
    child.expect("data-worker")
    child.expect("probe-server")
    child.expect(PROMPT)
    # a bad query prints the error with its position and the session goes on
    child.sendline("SELEC name FROM python.threads;")
    child.expect("syntax error")
    child.expect(r"\^")
    child.expect(PROMPT)
    # a multi-line statement runs when the ';' comes
    child.sendline("SELECT 40 + 2")
    child.sendline("  AS answer;")
    child.expect("answer")
    child.expect("42")
    child.expect(PROMPT)
    # a special command works
    child.sendline("\\bt data-worker")
    child.expect("data_worker")
    child.expect(PROMPT)
    child.sendline("\\format csv")
    child.expect("Output format is csv")
    child.sendline("SELECT 7 AS seven;")
    child.expect("seven\r\n7")
    # completion offers a column of the table named in FROM: `linen` only completes to `lineno`,
    # and the query fails unless Tab inserted it
    _wait_completion_ready(child)
    child.send("SELECT count(*) AS n FROM python.backtrace WHERE linen")
    child.send("\t")
    child.send(" > 0;\r")
    child.expect(r"n\r\n\d+")
    child.expect(PROMPT)
    # Ctrl-D leaves
    child.sendcontrol("d")
    child.expect(pexpect.EOF)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_until_grinding(child, cpu_s: float = 0.7, timeout: float = 8.0) -> None:
    """Wait until the REPL runs the statement: its terminal is out of prompt-toolkit's raw mode (so
    Ctrl-C is a SIGINT, not a keystroke read later) and it has burnt ``cpu_s`` of CPU since (far
    more than planning costs: DuckDB is grinding). CPU time, not wall time, so load cannot fool it."""
    assert poll(lambda: termios.tcgetattr(child.child_fd)[3] & termios.ISIG, timeout, interval=0.02), (
        "the REPL never left its prompt"
    )
    start = _cpu_s(child.pid)
    assert poll(lambda: _cpu_s(child.pid) - start >= cpu_s, timeout, interval=0.02), "the REPL never started the query"


def test_ctrl_c_cancels_a_long_query_in_the_repl(spawn, repl, cli):
    target = spawn(TARGETS / "idle.py")
    child = repl(target.pid)
    child.sendline(LONG_QUERY)
    _wait_until_grinding(child)
    child.sendcontrol("c")
    # cancelled (by Ctrl-C), not timed out (the query timeout is 10 s): the REPL says which ended it
    child.expect("cancelled after")
    # DuckDB runs in the REPL's own process (never in the target): Ctrl-C interrupts it there
    assert "stopped in this session's DuckDB" in child.before + child.after + child.readline()
    child.expect(PROMPT)
    child.sendline("SELECT 1 + 1 AS two;")
    child.expect("two")
    child.expect(PROMPT)
    # the target was never busy with it: a CLI query answers at once
    out = cli(target.pid, "query", "SELECT 3 AS three", "--format", "csv")
    assert out.returncode == 0 and "three\n3" in out.stdout, out.stderr


@pytest.mark.parametrize("how", ["kill", "terminate"])
def test_session_survives_the_target_exiting(spawn, repl, how):
    target = spawn(TARGETS / "idle.py")
    child = repl(target.pid)
    getattr(target.popen, how)()  # SIGKILL leaves nothing (no step, no snapshot); SIGTERM leaves a post-mortem record
    target.popen.wait(10)
    child.sendline("SELECT 1;")
    child.expect("it may have exited")
    child.expect(r"\\reconnect")
    child.expect(PROMPT)
    child.sendline("\\reconnect")
    if how == "kill":
        child.expect("no process with pid")
    else:
        child.expect(f"post-mortem record of pid {target.pid}: pid {target.pid} is gone \\(terminated")
        child.expect(PROMPT)
        child.sendline("SELECT exit_cause FROM process.info;")
        child.expect("terminated")
    child.expect(PROMPT)
    child.sendline("\\q")
    child.expect(pexpect.EOF)


@requires_torch
def test_repl_on_a_training_process_shows_its_step(spawn, repl):
    target = spawn([EXAMPLES / "train_gpt.py", "--steps", "0", "--step-sleep", "0.05"], ready="step 2")
    child = repl(target.pid, cpr=True)
    _expect_answering_cpr(child, PROMPT)
    child.sendline("SELECT pid FROM process.info;")
    _expect_answering_cpr(child, str(target.pid))
    # the toolbar shows the target's step and state (GET /health); later redraws only repaint
    # the digits that changed, so the whole line is matched once
    match = _expect_answering_cpr(child, r"step (\d+) \| (\w+)")
    assert int(match.group(1)) >= 2 and match.group(2) in ("training", "slow", "idle", "hung")


def test_piped_statements_run_without_a_terminal(spawn, cli):
    target = spawn(TARGETS / "idle.py")
    out = cli(target.pid, input="SELECT 1 AS one;\n\\format csv\nSELECT 2\n AS two;\nSELEC 3;\n")
    assert "one" in out.stdout and "two\n2" in out.stdout
    assert "syntax error" in out.stderr
    assert out.returncode == 1


def test_a_call_sqlglot_cannot_translate_is_one_sentence_and_the_session_goes_on(spawn, repl, cli):
    target = spawn(TARGETS / "idle.py")
    # given a call that sqlglot's own builder fails on: one sentence and exit 2 from the command
    r = cli(target.pid, "query", "SELECT date()")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "probe: date() with these arguments could not be read (ParseError: SQL cannot be None); check the arguments "
        "of its function calls."
    ], r.stderr
    # and in the REPL, the same sentence, then the prompt again for the next statement
    child = repl(target.pid)
    for sql in ("SELECT date();", "SELECT var_map('a');", "SELECT datetime('a');"):
        child.sendline(sql)
        child.expect("could not be read")
        child.expect(PROMPT)
    child.sendline("SELECT 41 + 1 AS answer;")
    child.expect("42")
    child.expect(PROMPT)
    assert child.isalive()
