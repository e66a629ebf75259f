"""The CLI's plumbing: what every front end (commands, REPL, page, MCP server) stands on.

``main`` parses ``probe [GLOBAL OPTIONS] [ENDPOINT] COMMAND`` and runs the command;
``session`` holds one invocation's options and hands out clients; ``endpoint`` turns a
pid, host:port, socket path or rank into a Target; ``client`` speaks HTTP to a probed
process; ``fanout`` is the one thread pool that asks several ranks at once; ``actions``
sends a guarded action and waits for it (several ranks at one common step); ``postmortem``
finds the records of processes that died and answers for one from its record, which ``records``
reads back as tables.
"""
