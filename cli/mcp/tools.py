"""MCP tools as thin wrappers over the registered CLI commands.

A tool's name, description and argument schema come from the command's registration
(its ``help`` and ``add_arguments``), so an agent reads the same documentation a person
does. Calling a tool parses the arguments with the command's own parser and runs the
command with a :class:`~probe.cli.plumbing.session.Session` whose output is captured, in
``--format json``, marked as coming from an agent (the probe server audits the marker).

This module does not import the MCP SDK: it turns commands into plain dicts and runs
them; :mod:`.server` wraps the results in MCP types.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from probe._errors import ProbeError


AGENT = "mcp"  # the marker every request of an MCP tool carries (audit.jsonl, probe.actions' client column)

READ_TOOLS = ("list", "status", "query", "tables", "describe", "backtrace", "trace", "doctor", "profile")
ACTION_TOOLS = ("lr", "checkpoint", "cleanup", "profile-steps", "guard")
NEVER = ("eval", "debug", "inject", "repl", "mcp")  # code execution, attaching, and interactive front ends

# Options that concern a terminal, not an agent (output is always JSON), or that an agent must not use.
_SKIP = {"format", "json", "expanded", "timing", "help", "now"}
_TARGET = {
    "endpoint": {
        "type": "string",
        "description": "pid, host:port or unix-socket path of the probed process (see the list tool).",
    },
    "rank": {"type": "integer", "description": "Talk to rank N (found in the registry) instead of an endpoint."},
    "ranks": {"type": "string", "description": "Several ranks: all, 3, 0-3, 0-3,7 (instead of endpoint or rank)."},
}
_NO_TARGET = {"list"}


@dataclass
class ToolSpec:
    name: str
    description: str
    input_schema: dict
    read_only: bool
    options: list = field(default_factory=list)  # (schema key, argparse action)


@dataclass
class ToolResult:
    text: str
    is_error: bool = False
    data: object = None  # the command's JSON output, parsed, when it printed JSON


def _schema_of(action: argparse.Action) -> dict:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        s: dict = {"type": "boolean"}
    elif action.type is int:
        s = {"type": "integer"}
    elif action.type is float:
        s = {"type": "number"}
    else:
        s = {"type": "string"}
    if action.choices:
        s["enum"] = list(action.choices)
    if action.help and action.help is not argparse.SUPPRESS:
        text = action.help % {"default": action.default} if "%(" in action.help else action.help
        s["description"] = re.sub(r",? or - (?:to read it from|reads) standard input", "", text)  # not over MCP
    return s


def _command_parser(cls) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"probe {cls.name}", add_help=False)
    cls.add_arguments(p)
    return p


def builtin_tables() -> list[dict]:
    """The built-in tables' catalog (``tables.json`` beside this module, generated from the table registry by
    ``python docs/generate.py --write``): read here instead of importing every table module into the client."""
    return json.loads((Path(__file__).resolve().parent / "tables.json").read_text())


def _query_context() -> str:
    """The built-in tables and their descriptions, for the query tool's description."""
    lines = [f"- {t['name']}: {t['description']}" for t in builtin_tables()]
    return (
        "\n\nRead-only: one SELECT (DuckDB dialect) over these tables; `describe` gives their columns, "
        "`tables` what a given process has (user tables included):\n" + "\n".join(lines)
    )


_OUTPUT_HELP = (
    "Also keep the result as a new file of this name (a plain name, no directory) in {dir}, the directory "
    "named when this server started; an existing file is never replaced. The content is returned either way."
)


def tool_specs(allow_actions: bool = False, output_dir: str | None = None) -> list[ToolSpec]:
    """The tools for the commands present in this installation, in a stable order.

    The read tier writes no files: a command's ``-o FILE`` is offered only when the person who started
    the server named a directory (``output_dir``), and then as a new file's name inside it.
    """
    from ..commands import COMMANDS, load_all

    load_all()
    names = [n for n in READ_TOOLS if n in COMMANDS] + (
        [n for n in ACTION_TOOLS if n in COMMANDS] if allow_actions else []
    )
    specs = []
    for name in names:
        cls = COMMANDS[name]
        props: dict = {}
        required: list = []
        options = []
        for action in _command_parser(cls)._actions:
            if action.dest in _SKIP or action.help is argparse.SUPPRESS:
                continue
            key = action.dest
            if key == "output" and name in READ_TOOLS:
                options.append((key, action))  # _argv sends the content to stdout whether or not it is offered
                if output_dir is not None:
                    props[key] = {"type": "string", "description": _OUTPUT_HELP.format(dir=output_dir)}
                continue
            props[key] = _schema_of(action)
            options.append((key, action))
            if (not action.option_strings and action.nargs not in ("?", "*")) or action.required:
                required.append(key)
        if name not in _NO_TARGET:
            props.update(_TARGET)
        read_only = name not in ACTION_TOOLS
        if not read_only:
            props["yes"] = {
                "type": "boolean",
                "description": "Confirm an action sent to several ranks (needed with ranks).",
            }
        description = cls.help
        if name == "query":
            description += _query_context()
        if not read_only:
            description += " Queued for the next step boundary and audited as coming from this agent."
        schema = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            schema["required"] = required
        specs.append(ToolSpec(name, description, schema, read_only, options))
    return specs


_parse_lock = threading.Lock()


def _argv(spec: ToolSpec, arguments: dict) -> list[str]:
    unknown = sorted(set(arguments) - set(spec.input_schema["properties"]))
    if unknown:
        raise ProbeError(
            f"{spec.name} does not take {', '.join(unknown)}; its arguments are "
            f"{', '.join(spec.input_schema['properties']) or 'none'}."
        )
    # Grouped stacks across ranks exist only as text (identical stacks merged, ranks listed); all else is JSON.
    grouped = spec.name == "backtrace" and arguments.get("group")
    argv = ["--format", "table" if grouped else "json"]
    if arguments.get("endpoint") not in (None, ""):
        argv += ["-t", str(arguments["endpoint"])]
    if arguments.get("rank") is not None:
        argv += ["--rank", str(arguments["rank"])]
    if arguments.get("ranks") not in (None, ""):
        argv += ["--ranks", str(arguments["ranks"])]
    if arguments.get("yes"):
        argv.append("--yes")
    argv.append(spec.name)
    positionals = []
    for key, action in spec.options:
        value = arguments.get(key)
        if (
            key == "output" and spec.read_only
        ):  # the content comes back on stdout; call_tool keeps a copy when asked (see _keep)
            if spec.name == "trace":
                argv += ["-o", "-"]
            if value not in (None, "") and spec.name == "profile" and arguments.get("format") is None:
                ext = os.path.splitext(str(value))[1].lower()
                argv += ["--format", {".svg": "svg", ".json": "speedscope"}.get(ext, "collapsed")]
            continue
        if value is None:
            continue
        if not action.option_strings:
            if str(value) == "-":  # standard input is the MCP channel itself
                raise ProbeError(f"{key} must be given as text; '-' (standard input) is not available over MCP.")
            positionals.append(str(value))
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv + (["--", *positionals] if positionals else [])


def _parse(argv: list[str]):
    """Parse with the CLI's own parser; argparse's complaint becomes a ProbeError."""
    from contextlib import redirect_stderr

    from ..plumbing.main import build_parser

    err = io.StringIO()
    with _parse_lock, redirect_stderr(err):
        parser, _ = build_parser()
        try:
            return parser.parse_args(argv)
        except SystemExit:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            msg = lines[-1].split("error:", 1)[-1].strip() if lines else "bad arguments"
            raise ProbeError(f"{msg}; see the tool's input schema.") from None


def _output_path(name, output_dir: str | None) -> str:
    """Where a tool's ``output`` goes: a plain new name inside ``output_dir``; ProbeError otherwise."""
    name = str(name)
    if output_dir is None:
        raise ProbeError("this server writes no files (start it with --output-dir DIR to allow new files there).")
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or any(not ch.isprintable() for ch in name)
        or len(name) > 200
    ):
        raise ProbeError(f"output must be a plain file name (no directory, not hidden), not {name[:80]!r}.")
    return os.path.join(output_dir, name)


def _keep(path: str, text: str) -> None:
    """Write ``text`` to a new file at ``path``: never over an existing file, never through a link
    (``probe.util.files.write_file``)."""
    from probe.util.files import write_file

    try:
        write_file(path, lambda f: f.write(text.encode()), replace=False, mode=0o600, fix="pick another name")
    except FileExistsError:
        raise ProbeError(f"{os.path.basename(path)} already exists in the output directory; pick a new name.") from None


def call_tool(
    spec: ToolSpec, arguments: dict | None, *, timeout: float | None = None, output_dir: str | None = None
) -> ToolResult:
    """Run the tool's command with captured output; a ProbeError becomes an error result.

    The command writes nothing itself: its output comes back here, and with ``output`` a copy is kept
    as a new file in ``output_dir`` (``_keep``)."""
    from ..commands import COMMANDS
    from ..plumbing.session import Session

    out, err = io.StringIO(), io.StringIO()
    try:
        keep = None
        if spec.read_only and (arguments or {}).get("output") not in (None, ""):
            keep = _output_path(arguments["output"], output_dir)
        args = _parse(_argv(spec, arguments or {}))
        if timeout and not args.timeout:
            args.timeout = timeout
        session = Session(args, stdout=out, stderr=err)
        session.agent = AGENT
        session.writes_files = not spec.read_only  # the read tier writes nothing, caches included (_keep aside)
        code = int(COMMANDS[spec.name]().run(session, args) or 0)
        if keep is not None and code == 0:
            _keep(keep, out.getvalue())
            err.write(f"probe: kept a copy in {keep}.\n")
    except ProbeError as exc:
        text = "\n".join(x for x in (out.getvalue().strip(), err.getvalue().strip(), f"probe: {exc.message}") if x)
        return ToolResult(text, is_error=True)
    text = out.getvalue().strip()
    notes = err.getvalue().strip()
    data = None
    with contextlib.suppress(ValueError):
        data = json.loads(text) if text else None
    if notes:
        text = f"{text}\n{notes}" if text else notes
    return ToolResult(text or "(no output)", is_error=code != 0, data=data)
