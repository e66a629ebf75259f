"""``probe ui``: serve a live web page of the job from this process (never from the training one)."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

from probe._errors import ProbeError

from . import Command, command


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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

        if not _is_loopback(args.host) and not args.expose:
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
        if not _is_loopback(args.host):
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
