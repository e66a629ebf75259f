"""The command registry. A command is a class registered with ``@command``; its name,
help and arguments come from the registration, and ``probe --help`` is generated from
it.

Each command lives in the module named after it (``profile-steps`` in
``profile_steps.py``), so ``find`` imports only the module of the command being run
(start-up is part of the interface: ``probe PID backtrace`` must not pay for every
other command's imports). ``load_all`` imports every module of this package, for the
full help, the docs, the REPL, the page and the MCP server. Modules whose name starts
with ``_`` hold what several commands share and declare no command.

(Once imported, the submodules ``list`` and ``eval`` are attributes of this package and
shadow those builtins here: this module does not call them.)
"""

from __future__ import annotations

import importlib
import os

__all__ = ["Command", "command", "COMMANDS", "find", "load_all", "command_modules", "format_flag"]

COMMANDS: dict[str, type] = {}


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
    return name.replace("-", "_")


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
