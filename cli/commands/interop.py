"""Interop: ``mcp`` (probe for AI agents over the Model Context Protocol)."""

from __future__ import annotations

from probe._errors import ProbeError

from . import Command, command


@command("mcp", "Serve probe's read commands (and, with --allow-actions, lr/checkpoint/cleanup) to an AI agent over MCP on stdio.")
class Mcp(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--allow-actions", action="store_true",
                       help="Also offer lr, checkpoint and cleanup (audited as the agent's); eval and debug are never offered.")

    def run(self, session, args):
        if args.endpoint or args.rank is not None or getattr(args, "ranks", None):
            raise ProbeError("`probe mcp` serves every probed process; the agent picks one per call, so give no ENDPOINT, --rank or --ranks.")
        try:
            from ..mcp import serve_stdio  # the MCP SDK is imported here only, never at the CLI's start-up
        except ImportError as exc:
            raise ProbeError(f"`probe mcp` needs the MCP SDK ({exc.name} is missing); install it with `pip install mcp`.") from None
        serve_stdio(allow_actions=args.allow_actions, timeout=args.timeout)
        return 0
