"""Start-up of the one-shot `probe` command: a command imports only what it needs.

What a command imports is behaviour (which modules load), so it is asserted here; how long
start-up takes depends on the machine and is measured by benchmarks/bench_startup.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TARGETS

# Imported by `probe PID backtrace` on its usual path (the server answers), they would cost the start-up
# more than the rest of the command: the query engine, the attach ladder (py-spy's fallback imports it), the
# doctor's rules. (The settings parser does load: the runtime directory is a setting, and it costs ~0.2 ms.)
HEAVY = ("duckdb", "sqlglot", "numpy", "probe.sql", "probe.injector", "probe.diagnosis", "probe.tables", "torch")

RUN = """
import json, sys
from probe.cli import main
code = main(sys.argv[1:])
sys.stdout.flush()
print("MODULES " + json.dumps(sorted(sys.modules)))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def idle(shared_spawn):
    return shared_spawn(TARGETS / "idle.py")


def _run(env, *argv) -> tuple[subprocess.CompletedProcess, list[str]]:
    r = subprocess.run(
        [sys.executable, "-c", RUN, *map(str, argv)], capture_output=True, text=True, env=env, timeout=180
    )
    head, _, mods = r.stdout.rpartition("MODULES ")
    r.stdout = head
    return r, json.loads(mods) if mods else []


def test_backtrace_imports_no_engine_no_injector_and_no_other_command(idle, shared_env):
    # when: the real CLI entry point backtraces a live probed process
    r, mods = _run(shared_env, idle.pid, "backtrace")
    # then: the stacks came from the server, and nothing heavy or unrelated was imported on the way
    assert r.returncode == 0, r.stderr
    assert "main_loop" in r.stdout and "data-worker" in r.stdout, r.stdout
    heavy = [m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == [], f"`probe PID backtrace` imported {heavy}"
    commands = [m for m in mods if m.startswith("probe.cli.commands.")]
    assert commands == ["probe.cli.commands.backtrace"], commands


def test_help_lists_every_command_without_importing_the_engine(shared_env):
    from probe.cli.commands import COMMANDS, load_all

    r, mods = _run(shared_env, "--help")
    assert r.returncode == 0, r.stderr
    names = {cls.name for cls in load_all().values()}
    assert names and all(n in r.stdout for n in names), r.stdout
    assert len(names) < len(COMMANDS)  # aliases are listed beside their command, not on their own
    assert not [m for m in mods if m.split(".")[0] in ("duckdb", "sqlglot", "numpy", "torch")]


def test_an_alias_and_a_command_name_run_the_same_command(idle, shared_env):
    # `bt` is declared only as an alias of backtrace: finding it loads the command modules, then runs backtrace
    by_alias, _ = _run(shared_env, idle.pid, "bt", "--format", "json")
    by_name, _ = _run(shared_env, idle.pid, "backtrace", "--format", "json")
    assert by_alias.returncode == by_name.returncode == 0, by_alias.stderr + by_name.stderr
    threads = [sorted(t["name"] for t in json.loads(r.stdout)["threads"]) for r in (by_alias, by_name)]
    assert threads[0] == threads[1] and "data-worker" in threads[0]


def test_every_command_lives_in_the_module_find_imports_for_it():
    """``find`` imports only ``commands/<name>.py`` for command ``name``, or the module ``SHARED`` names for it:
    that holds only if each command is declared there."""
    from probe.cli.commands import SHARED, command_modules, load_all

    home = {name: module for module, names in SHARED.items() for name in names}
    commands = load_all()
    for name, cls in commands.items():
        if name == cls.name:
            module = home.get(name, name.replace("-", "_"))
            assert cls.__module__ == f"probe.cli.commands.{module}", (name, cls.__module__)
    assert set(home) <= {cls.name for cls in commands.values()}, "SHARED names a command that does not exist"
    declared = {cls.__module__.rpartition(".")[2] for cls in commands.values()}
    assert declared == set(command_modules()), (
        "a command module that declares no command (shared code goes in a _module)"
    )


def test_an_unknown_command_is_one_sentence_and_a_failure(idle, shared_env):
    r, _ = _run(shared_env, idle.pid, "backtrce")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("probe: unknown command 'backtrce'; commands: ") and "backtrace" in r.stderr, r.stderr


def test_the_mcp_tools_describe_the_tables_without_importing_them():
    """The MCP server's tool descriptions and its table catalog come from a generated file, not from importing
    every table module (and with them the training side's code) into the client."""
    script = (
        "import json, sys\n"
        "from probe.cli.mcp.tools import builtin_tables, tool_specs\n"
        "specs = tool_specs()\n"
        "print(json.dumps([len(builtin_tables()), [s.description for s in specs if s.name == 'query'],"
        " sorted(m for m in sys.modules if m.startswith(('probe.tables', 'probe.training')))]))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    tables, (query,), imported = json.loads(r.stdout)
    assert tables >= 20 and "torch.steps:" in query, query
    assert imported == [], imported
