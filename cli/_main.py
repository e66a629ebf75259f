"""Entry point: ``probe [GLOBAL OPTIONS] [ENDPOINT] COMMAND [ARGS]``.

The first positional word is a command when it names one, otherwise it is the
ENDPOINT (a pid, host:port or socket path) and the command follows; no command
after an endpoint opens the REPL. Global options may appear anywhere.
"""

from __future__ import annotations

import argparse
import sys

from probe._errors import ProbeError

from ._session import Session
from .commands import COMMANDS, load_all

__all__ = ["main"]

_VALUE_OPTIONS = {"-t", "--target", "--rank", "--ranks", "--timeout", "--token", "--format"}


def _global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    d = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group("global options")
    g.add_argument("-t", "--target", dest="endpoint", metavar="ENDPOINT", default=d,
                   help="pid, host:port or unix-socket path of the probed process.")
    g.add_argument("--rank", type=int, metavar="N", default=d, help="Talk to rank N (found in the registry).")
    g.add_argument("--ranks", metavar="SPEC", default=d, help="Talk to several ranks: all, 3, 0-3, 0-3,7.")
    g.add_argument("--timeout", type=float, metavar="S", default=d, help="Seconds to wait for an answer (default 10).")
    g.add_argument("--token", default=d, help="Token for TCP endpoints (default: $PROBE_TOKEN, or the local registry).")
    g.add_argument("--format", choices=("table", "json", "csv"), default=d, help="Output format (default table).")
    g.add_argument("--yes", action="store_true", default=d if suppress else False,
                   help="Do not ask before a mutating command to several ranks.")


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
    if first in COMMANDS:
        return None, first, argv
    rest = argv[: positionals[0]] + argv[positionals[0] + 1:]
    cmd = argv[positionals[1]] if len(positionals) > 1 else None
    return first, cmd, rest


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(
        prog="probe",
        description="Live debugging of running PyTorch training jobs: SQL over live tables, backtraces, guarded actions.",
        epilog="ENDPOINT is a pid, host:port or unix-socket path; `probe ENDPOINT` alone opens the SQL REPL.",
    )
    _global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, suppress=True)
    seen = {}
    for name, cls in COMMANDS.items():
        if name != cls.name:
            continue
        p = sub.add_parser(name, help=cls.help, description=cls.help, parents=[common], aliases=list(cls.aliases))
        cls.add_arguments(p)
        seen[name] = cls
    return parser, seen


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _stop_inherited_probe()
        load_all()
        endpoint, cmd, rest = _split(argv)
        if endpoint is not None and not _looks_like_endpoint(endpoint):
            raise ProbeError(f"unknown command '{endpoint}'; run `probe --help` for the commands, or give an ENDPOINT (pid, host:port or socket path) first.")
        if endpoint is not None and cmd is None:
            if "-h" in rest or "--help" in rest:
                cmd = None
            elif "repl" in COMMANDS:
                rest = rest + ["repl"]
                cmd = "repl"
        if endpoint is not None and cmd is not None and cmd not in COMMANDS:
            raise ProbeError(f"unknown command '{cmd}'; commands: {', '.join(sorted(c.name for c in set(COMMANDS.values())))}.")
        if endpoint is None and cmd is None and not any(a in ("-h", "--help") for a in argv):
            first = next((a for a in argv if not a.startswith("-")), None)
            if first is not None:
                raise ProbeError(f"unknown command '{first}'; run `probe --help` for the commands.")
        parser, _ = build_parser()
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
        print(f"probe: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("probe: interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def _looks_like_endpoint(word: str) -> bool:
    return word.isdigit() or ":" in word or "/" in word or word.endswith(".sock")


def _stop_inherited_probe() -> None:
    """With PROBE=1 exported in the shell, the CLI itself must not serve a probe."""
    mod = sys.modules.get("probe.agent.lifecycle")
    if mod is not None and mod.is_running():
        mod.stop()
