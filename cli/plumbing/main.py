"""Entry point: ``probe [GLOBAL OPTIONS] [ENDPOINT] COMMAND [ARGS]``.

The first positional word is a command when it names one, otherwise it is the
ENDPOINT (a pid, host:port or socket path) and the command follows; no command
after an endpoint opens the REPL. Global options may appear anywhere.
"""

from __future__ import annotations

import argparse
import sys

from probe._errors import ProbeError

from ..commands import COMMANDS, find, load_all
from .session import Session


_VALUE_OPTIONS = {"-t", "--target", "--rank", "--ranks", "--job", "--timeout", "--token", "--format"}


def _global_options(parser: argparse.ArgumentParser, suppress: bool, output_format: bool = True) -> None:
    d = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group("global options")
    g.add_argument(
        "-t",
        "--target",
        dest="endpoint",
        metavar="ENDPOINT",
        default=d,
        help="pid, host:port or unix-socket path of the probed process.",
    )
    g.add_argument("--rank", type=int, metavar="N", default=d, help="Talk to rank N (found in the registry).")
    g.add_argument("--ranks", metavar="SPEC", default=d, help="Talk to several ranks: all, 3, 0-3, 0-3,7.")
    g.add_argument(
        "--job",
        metavar="ID",
        default=d,
        help="With --rank/--ranks when several jobs run here: the job (its id or a prefix, see `probe list`).",
    )
    g.add_argument("--timeout", type=float, metavar="S", default=d, help="Seconds to wait for an answer (default 10).")
    g.add_argument(
        "--token",
        default=d,
        help="The job's token (or one rank's key) for TCP endpoints, never sent (default: $PROBE_TOKEN, the registry).",
    )
    if output_format:
        g.add_argument("--format", choices=("table", "json", "csv"), default=d, help="Output format (default table).")
    g.add_argument(
        "--yes",
        action="store_true",
        default=d if suppress else False,
        help="Do not ask before a mutating command to several ranks.",
    )


def _split(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """Find (endpoint, command name, argv without the endpoint word)."""
    i = 0
    positionals = []
    while i < len(argv):
        a = argv[i]
        if a == "--":
            break
        if a in _VALUE_OPTIONS:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        positionals.append(i)
        if len(positionals) == 2:
            break
        i += 1
    if not positionals:
        return None, None, argv
    first = argv[positionals[0]]
    if not _looks_like_endpoint(first) and find(first) is not None:
        return None, first, argv
    rest = argv[: positionals[0]] + argv[positionals[0] + 1 :]
    cmd = argv[positionals[1]] if len(positionals) > 1 else None
    return first, cmd, rest


def build_parser(names: list[str] | None = None, *, arguments: bool = True) -> tuple[argparse.ArgumentParser, dict]:
    """The ``probe`` parser with a subparser for each command in ``names`` (default: every command).

    ``main`` builds only the command being run (argparse's set-up for every command's
    arguments costs more start-up than the rest of a backtrace); ``arguments=False`` builds
    each subparser with its help line only, enough for ``probe --help``'s list of commands
    (in alphabetical order, whatever order their modules were imported in).
    """
    chosen = [find(n) for n in names] if names is not None else sorted(set(load_all().values()), key=lambda c: c.name)
    parser = argparse.ArgumentParser(
        prog="probe",
        description=(
            "Live debugging of running PyTorch training jobs: SQL over live tables, backtraces, guarded actions."
        ),
        epilog="ENDPOINT is a pid, host:port or unix-socket path; `probe ENDPOINT` alone opens the SQL REPL.",
    )
    _global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, suppress=True)
    common_own_format = argparse.ArgumentParser(add_help=False)  # for commands with their own --format
    _global_options(common_own_format, suppress=True, output_format=False)
    seen = {}
    for cls in chosen:
        if cls is None or cls.name in seen:
            continue
        p = sub.add_parser(
            cls.name,
            help=cls.help,
            description=cls.help,
            parents=[common_own_format if cls.own_format else common],
            aliases=list(cls.aliases),
        )
        if arguments:
            cls.add_arguments(p)
        seen[cls.name] = cls
    return parser, seen


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _stop_inherited_probe()
        endpoint, cmd, rest = _split(argv)
        if endpoint is not None and not _looks_like_endpoint(endpoint):
            raise ProbeError(
                f"unknown command '{endpoint}'; run `probe --help` for the commands, or give an ENDPOINT (pid, "
                "host:port or socket path) first."
            )
        if endpoint is not None and cmd is None:
            if "-h" in rest or "--help" in rest:
                cmd = None
            elif find("repl") is not None:
                rest = rest + ["repl"]
                cmd = "repl"
        if endpoint is not None and cmd is not None and find(cmd) is None:
            raise ProbeError(
                f"unknown command '{cmd}'; commands: {', '.join(sorted(c.name for c in set(load_all().values())))}."
            )
        if endpoint is None and cmd is None and not any(a in ("-h", "--help") for a in argv):
            first = next((a for a in argv if not a.startswith("-")), None)
            if first is not None:
                raise ProbeError(f"unknown command '{first}'; run `probe --help` for the commands.")
        # only the command being run gets its arguments; no command: every command's help line, for --help
        parser, _ = build_parser([cmd]) if cmd is not None else build_parser(arguments=False)
        try:
            args = parser.parse_args(rest)
        except SystemExit as exc:
            return int(exc.code or 0)
        if endpoint is not None:
            if getattr(args, "endpoint", None):
                raise ProbeError("give the ENDPOINT once: either as the first word or with -t, not both.")
            args.endpoint = endpoint
        if not args.command:
            parser.print_help()
            return 2
        cls = COMMANDS[args.command]
        session = Session(args)
        return int(cls().run(session, args) or 0)
    except ProbeError as exc:
        from probe.util.printable import terminal_text  # an endpoint's error text or a process's exception: escaped

        print(f"probe: {terminal_text(exc.message)}", file=sys.stderr)
        if getattr(exc, "abandoned", False):  # a DuckDB query that ignored its interrupt still runs: do not wait for it
            import os

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        print("probe: interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def entry() -> None:
    """The ``probe`` console script (and ``python -m probe``): ``main``, then out at once with its exit code.

    The streams are flushed, and the interpreter's teardown is skipped: with DuckDB loaded, a daemon
    thread that takes the GIL back while the interpreter finalizes is ended by ``pthread_exit``
    through DuckDB's C++ frames, and the process aborted (exit -6, "FATAL: exception not rethrown")
    after printing a correct answer. Nothing of the CLI needs the teardown: it writes its files as it
    goes, and its temporary directories are removed by the code that made them."""
    import os

    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`probe ... | head`), or a closed stream
            pass
    os._exit(code)


def _looks_like_endpoint(word: str) -> bool:
    return word.isdigit() or ":" in word or "/" in word or word.endswith(".sock")


def _stop_inherited_probe() -> None:
    """With PROBE=1 exported in the shell, the CLI itself must not serve a probe."""
    mod = sys.modules.get("probe.agent.lifecycle")
    if mod is not None and mod.is_running():
        mod.stop()
