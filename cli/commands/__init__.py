"""The command registry. A command is a class registered with ``@command``; its name,
help and arguments come from the registration, and ``probe --help`` is generated from
it. Modules listed in ``MODULES`` are imported on demand to fill the registry."""

from __future__ import annotations

import importlib

__all__ = ["Command", "command", "COMMANDS", "load_all"]

COMMANDS: dict[str, type] = {}
MODULES = ("core", "repl", "attach", "actions", "ranks", "doctor")


class Command:
    """Base class: a subcommand's name, help, aliases and arguments, and its ``run``."""

    name = ""
    help = ""
    aliases: tuple[str, ...] = ()

    @staticmethod
    def add_arguments(parser) -> None:
        pass

    def run(self, session, args) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


def command(name: str, help: str, *, aliases: tuple[str, ...] = ()):
    def register(cls):
        cls.name, cls.help, cls.aliases = name, help, aliases
        COMMANDS[name] = cls
        for a in aliases:
            COMMANDS[a] = cls
        return cls

    return register


def load_all() -> dict[str, type]:
    for mod in MODULES:
        name = f"{__name__}.{mod}"
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a module that exists but fails to import is a bug: show it
                raise
            # listed but not present (a partial install): its commands are simply absent;
            # tests/test_tables.py checks that every listed module imports.
    return COMMANDS
