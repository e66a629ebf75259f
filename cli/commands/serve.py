"""The commands that serve probe to other front ends from this process (never from the training one): ``ui``, a
live web page of the job, and ``mcp``, probe for AI agents over the Model Context Protocol (stdio, or HTTP on
loopback). They share this module: each starts, in this client, a server for another front end.
"""

from __future__ import annotations

import os
import socket
import sys

from probe._errors import ProbeError
from probe.util.handshake import is_loopback

from . import Command, command


@command(
    "ui",
    "Serve a live web page of the job (ranks, curves, time per module, stacks, flamegraph, SQL) on loopback, behind a "
    "token.",
)
class Ui(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: a free one).")
        p.add_argument(
            "--host",
            default="127.0.0.1",
            help="Address to listen on (default 127.0.0.1); anything but loopback also needs --expose.",
        )
        p.add_argument(
            "--expose",
            action="store_true",
            help="Allow a non-loopback --host: anyone who can reach it and has the URL's token reads the job.",
        )
        p.add_argument(
            "--open",
            action="store_true",
            help=(
                "Open the page in this machine's web browser (through a private 0600 file: the token is never on a "
                "command line)."
            ),
        )
        p.add_argument(
            "--allow-actions",
            action="store_true",
            help="Let the page start cleanup, checkpoint and lr changes (each confirmed on the page).",
        )
        p.add_argument("--refresh", type=float, default=3.0, help="Seconds between the page's refreshes (default 3).")

    def run(self, session, args):
        import threading

        from ..ui.server import UIServer

        if not is_loopback(args.host) and not args.expose:
            raise ProbeError(
                f"--host {args.host} is not a loopback address; add --expose to serve the page there "
                "(anyone who can reach it and has the token reads the job), or use the ssh -L line instead."
            )
        if not 0 <= args.port <= 65535:
            raise ProbeError(f"--port must be between 0 and 65535, got {args.port}.")
        if args.refresh < 0.5:
            raise ProbeError("--refresh must be at least 0.5 seconds.")
        session.targets()  # a wrong ENDPOINT or --ranks fails now, with the CLI's sentence, not on the page
        quiet = open(os.devnull, "w")  # noqa: SIM115  (partial fan-out answers are shown on the page, not here)
        from ..plumbing.session import Session

        page_session = Session(args, stdout=quiet, stderr=quiet)
        try:
            server = UIServer(
                page_session, args.host, args.port, allow_actions=args.allow_actions, refresh=args.refresh
            )
        except OSError as exc:
            raise ProbeError(
                f"cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port."
            ) from None
        url = server.url(args.host)
        session.print(f"probe ui: serving {url}")
        if not is_loopback(args.host):
            session.note(
                f"probe ui: WARNING: listening on {args.host}, not loopback: anyone who can reach "
                f"port {server.port} and has the URL above can read this job's stacks and tables."
            )
        local = f"http://127.0.0.1:{server.port}/{server.token}/"
        session.print(
            f"probe ui: from a laptop: ssh -N -L {server.port}:127.0.0.1:{server.port} {socket.gethostname()}  "
            f"then open {local}"
        )
        if args.allow_actions:
            session.note("probe ui: actions are allowed from the page (each needs a confirmation there).")
        session.print("probe ui: Ctrl-C stops it.")
        stop = threading.Event()
        server.start()
        if args.open:
            if sys.platform == "darwin" or os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
                server.open_browser(url)
            else:  # a console browser would take over this terminal
                session.note(
                    "probe ui: --open: no graphical display here; open the URL above (or the ssh -L line's) yourself."
                )
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
            server.server_close()
            server.forget_launch_file()
            quiet.close()
        session.note("probe ui: stopped.")
        return 0


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
