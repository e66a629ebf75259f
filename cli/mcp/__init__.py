"""``probe mcp``: probe's commands as Model Context Protocol tools for AI agents.

Only ``probe mcp`` imports this package (and with it the MCP SDK); no other command
pays for it at start-up. ``probe mcp --http`` also imports :mod:`.http`, the HTTP glue.
"""

from .server import build_server, serve_stdio, tool_specs

__all__ = ["build_server", "serve_stdio", "tool_specs"]
