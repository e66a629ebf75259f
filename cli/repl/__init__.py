"""The interactive SQL REPL: ``loop`` (prompt and dispatch, and the backslash commands' registry),
``session`` (switchable target, background schema refresh, statements run and cancelled) and
``completer`` (live-schema completion)."""
