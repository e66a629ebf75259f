"""``probe mcp``: probe for AI agents over the Model Context Protocol (stdio, or HTTP on loopback)."""

from __future__ import annotations

from probe._errors import ProbeError

from . import Command, command


@command(
    "mcp",
    "Serve probe's read commands (and, with --allow-actions, lr/checkpoint/cleanup/profile-steps) to an AI agent over "
    "MCP on stdio, or with --http over HTTP on loopback behind a token.",
)
class Mcp(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument(
            "--allow-actions",
            action="store_true",
            help=(
                "Also offer lr, checkpoint, cleanup and profile-steps (audited as the agent's); eval and debug are "
                "never offered."
            ),
        )
        p.add_argument(
            "--http",
            metavar="[HOST:]PORT",
            help="Serve over streamable HTTP instead of stdio, at http://HOST:PORT/mcp (HOST defaults to 127.0.0.1; "
            "PORT 0 picks a free one); clients send the printed token as 'Authorization: Bearer TOKEN' "
            "(set PROBE_MCP_TOKEN to choose it).",
        )
        p.add_argument(
            "--expose",
            action="store_true",
            help="With --http: allow a non-loopback HOST; anyone who can reach it and has the token can use the tools.",
        )
        p.add_argument(
            "--output-dir",
            metavar="DIR",
            help="Let the read tools (trace, profile) keep a copy of their result as a new file in DIR; "
            "without it they write no files and return the content.",
        )

    def run(self, session, args):
        if args.endpoint or args.rank is not None or getattr(args, "ranks", None):
            raise ProbeError(
                "`probe mcp` serves every probed process; the agent picks one per call, so give no ENDPOINT, --rank or "
                "--ranks."
            )
        if args.expose and not args.http:
            raise ProbeError(
                "--expose only applies to --http [HOST:]PORT; stdio serves just the program that started it."
            )
        try:  # the MCP SDK is imported here only, never at the CLI's start-up
            if args.http:
                from ..mcp.http import http_token, parse_address, serve_http
            else:
                from ..mcp import serve_stdio
        except ImportError as exc:
            raise ProbeError(
                f"`probe mcp` needs the MCP SDK ({exc.name} is missing); install it with `pip install mcp`."
            ) from None
        output_dir = None
        if args.output_dir:
            import os

            output_dir = os.path.realpath(os.path.expanduser(args.output_dir))
            if not os.path.isdir(output_dir):
                raise ProbeError(f"--output-dir {args.output_dir} is not a directory; create it first.")
            from probe.util.files import check_directory

            check_directory(os.stat(output_dir), output_dir)  # one where no one else can swap the files kept there
        if not args.http:
            serve_stdio(allow_actions=args.allow_actions, timeout=args.timeout, output_dir=output_dir)
            return 0
        from probe.config import setting

        host, port = parse_address(args.http)
        token, generated = http_token(setting("PROBE_MCP_TOKEN", strict=True))

        def announce(url, loopback):
            session.note(
                f"probe mcp: {url} token {token if generated else '$PROBE_MCP_TOKEN'}"
                f" (send 'Authorization: Bearer <token>'){'; actions allowed' if args.allow_actions else ''}; Ctrl-C "
                "stops it."
            )
            if not loopback:
                session.note(
                    f"probe mcp: WARNING: listening on {host}, not loopback, over plain HTTP: anyone who can "
                    "reach it and sees the token can use the tools; prefer loopback and ssh -L."
                )

        serve_http(
            host,
            port,
            token=token,
            announce=announce,
            expose=args.expose,
            allow_actions=args.allow_actions,
            timeout=args.timeout,
            output_dir=output_dir,
        )
        session.note("probe mcp: stopped.")
        return 0
