"""The command registry. A command is a class registered with ``@command``; its name,
help and arguments come from the registration, and ``probe --help`` is generated from
it.

A command lives in the module named after it, or, when it is one of a few small commands of
one shape, in the module of its kind that ``SHARED`` names (the guarded actions in ``actions``,
the SQL commands in ``query``, the recordings in ``profile``, the servers in ``serve``): one
file then holds what they share and every use of it. So ``find`` imports only the module of the
command being run (start-up is part of the interface: ``probe PID backtrace`` must not pay for
every other command's imports). ``load_all`` imports every module of this package, for the
full help, the docs, the REPL, the page and the MCP server.

(Once imported, the submodule ``list`` is an attribute of this package and shadows that
builtin here: this module does not call it.)
"""

from __future__ import annotations

import importlib
import os

__all__ = ["Command", "command", "COMMANDS", "SHARED", "find", "load_all", "command_modules", "format_flag"]

COMMANDS: dict[str, type] = {}

# the modules that declare several commands, and those commands (tests/unit checks that it is complete)
SHARED = {
    "actions": ("eval", "checkpoint", "cleanup", "debug", "cancel"),
    "query": ("query", "tables", "describe", "repl"),
    "profile": ("profile", "profile-steps", "trace"),
    "serve": ("ui", "mcp"),
    "training": ("lr", "guard"),
}
_HOME = {name: module for module, names in SHARED.items() for name in names}


class Command:
    """Base class: a subcommand's name, help, aliases and arguments, and its ``run``."""

    name = ""
    help = ""
    aliases: tuple[str, ...] = ()
    own_format = False  # True: the command defines its own --format instead of the global table/json/csv

    @staticmethod
    def add_arguments(parser) -> None:
        pass

    def run(self, session, args) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


def command(name: str, help: str, *, aliases: tuple[str, ...] = (), own_format: bool = False):
    def register(cls):
        cls.name, cls.help, cls.aliases, cls.own_format = name, help, aliases, own_format
        COMMANDS[name] = cls
        for a in aliases:
            COMMANDS[a] = cls
        return cls

    return register


def format_flag(
    parser, choices: tuple = ("table", "json", "csv"), help: str = "Output format (same as --format)."
) -> None:
    """``-f FORMAT``, the short form of the global ``--format``, for the commands that print results."""
    import argparse

    parser.add_argument("-f", dest="format", choices=choices, default=argparse.SUPPRESS, help=help)


def command_modules() -> list[str]:
    """The modules of this package that declare commands (every ``*.py`` not starting with ``_``)."""
    here = os.path.dirname(__file__)
    return sorted(f[:-3] for f in os.listdir(here) if f.endswith(".py") and not f.startswith("_"))


def _module_of(name: str) -> str:
    return _HOME.get(name, name.replace("-", "_"))


def find(name: str) -> type | None:
    """The command class called ``name`` (or aliased so), or None; imports only its own module
    when ``name`` is a command's name, and every command module only for an alias or an unknown word."""
    if name in COMMANDS:
        return COMMANDS[name]
    mod = _module_of(name)
    if (
        mod.isidentifier()
        and not mod.startswith("_")
        and os.path.exists(os.path.join(os.path.dirname(__file__), mod + ".py"))
    ):
        importlib.import_module(f"{__name__}.{mod}")
        if name in COMMANDS:
            return COMMANDS[name]
    return load_all().get(name)


def load_all() -> dict[str, type]:
    for mod in command_modules():
        importlib.import_module(f"{__name__}.{mod}")  # a module that fails to import is a bug: let it show
    return COMMANDS
