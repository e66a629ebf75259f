"""The interactive SQL REPL: ``loop`` (prompt and dispatch), ``session`` (switchable
target, background schema refresh), ``executor`` (statements, cancel), ``completer``
(live-schema completion) and ``special`` (backslash commands, a registry)."""
