"""Interop: ``mcp`` (probe for AI agents over the Model Context Protocol)."""

from __future__ import annotations

from probe._errors import ProbeError

from . import Command, command


@command("mcp", "Serve probe's read commands (and, with --allow-actions, lr/checkpoint/cleanup/profile-steps) to an AI agent over MCP on stdio, or with --http over HTTP on loopback behind a token.")
class Mcp(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--allow-actions", action="store_true",
                       help="Also offer lr, checkpoint, cleanup and profile-steps (audited as the agent's); eval and debug are never offered.")
        p.add_argument("--http", metavar="[HOST:]PORT",
                       help="Serve over streamable HTTP instead of stdio, at http://HOST:PORT/mcp (HOST defaults to 127.0.0.1; "
                            "PORT 0 picks a free one); clients send the printed token as 'Authorization: Bearer TOKEN' "
                            "(set PROBE_MCP_TOKEN to choose it).")
        p.add_argument("--expose", action="store_true",
                       help="With --http: allow a non-loopback HOST; anyone who can reach it and has the token can use the tools.")
        p.add_argument("--output-dir", metavar="DIR",
                       help="Let the read tools (trace, profile) keep a copy of their result as a new file in DIR; "
                            "without it they write no files and return the content.")

    def run(self, session, args):
        if args.endpoint or args.rank is not None or getattr(args, "ranks", None):
            raise ProbeError("`probe mcp` serves every probed process; the agent picks one per call, so give no ENDPOINT, --rank or --ranks.")
        if args.expose and not args.http:
            raise ProbeError("--expose only applies to --http [HOST:]PORT; stdio serves just the program that started it.")
        try:  # the MCP SDK is imported here only, never at the CLI's start-up
            if args.http:
                from ..mcp.http import http_token, parse_address, serve_http
            else:
                from ..mcp import serve_stdio
        except ImportError as exc:
            raise ProbeError(f"`probe mcp` needs the MCP SDK ({exc.name} is missing); install it with `pip install mcp`.") from None
        output_dir = None
        if args.output_dir:
            import os

            output_dir = os.path.realpath(os.path.expanduser(args.output_dir))
            if not os.path.isdir(output_dir):
                raise ProbeError(f"--output-dir {args.output_dir} is not a directory; create it first.")
        if not args.http:
            serve_stdio(allow_actions=args.allow_actions, timeout=args.timeout, output_dir=output_dir)
            return 0
        from probe._config import setting

        host, port = parse_address(args.http)
        token, generated = http_token(setting("PROBE_MCP_TOKEN", strict=True))

        def announce(url, loopback):
            session.note(f"probe mcp: {url} token {token if generated else '$PROBE_MCP_TOKEN'}"
                         f" (send 'Authorization: Bearer <token>'){'; actions allowed' if args.allow_actions else ''}; Ctrl-C stops it.")
            if not loopback:
                session.note(f"probe mcp: WARNING: listening on {host}, not loopback, over plain HTTP: anyone who can "
                             "reach it and sees the token can use the tools; prefer loopback and ssh -L.")

        serve_http(host, port, token=token, announce=announce, expose=args.expose, allow_actions=args.allow_actions,
                   timeout=args.timeout, output_dir=output_dir)
        session.note("probe mcp: stopped.")
        return 0


def run_sql(session, target, sql: str):
    """One read-only query on one process; the one place this module asks for rows (a Result).

    Federation with one process: its snapshots, DuckDB here in the client.
    """
    from .._federation import federated_query

    return federated_query(session, sql, targets=[target])


def _rows(result) -> list[dict]:
    return [dict(zip(result.columns, r)) for r in result.rows]


def _timeline_rows(session, target, steps: int):
    """The last ``steps`` steps of one process, with their module trace, spans and collectives."""
    from .._timeline import RankRows

    tables = {t["name"] for t in session.client(target).get("/tables")["tables"]}
    last = run_sql(session, target, "SELECT MAX(step) AS s FROM torch.steps").rows[0][0]
    rank = target.rank if target.rank is not None else target.entry.get("rank")
    label = " · ".join(x for x in (f"rank {rank}" if rank is not None else None,
                                   f"pid {target.pid}" if target.pid else None) if x) or target.label
    rr = RankRows(rank=rank, pid=target.pid, label=label)
    notes = []
    if last is None:
        notes.append(f"{target.label}: no training step recorded yet (torch.steps is empty)")
        window = "> 0"
    else:  # the last `steps` completed steps, fixed now: training goes on while we ask
        window = f"BETWEEN {int(last) - steps + 1} AND {int(last)}"
        rr.steps = _rows(run_sql(session, target,
            f"SELECT step, epoch(started_at) AS start, duration, loss, lr FROM torch.steps WHERE step {window} ORDER BY step"))
    mod_sql = ("SELECT step, epoch(time) AS start, duration, module, stage, depth, module_type, model "
               "FROM python.torch_trace WHERE step {} ORDER BY time")
    rr.modules = _rows(run_sql(session, target, mod_sql.format(window)))
    if not rr.modules and last is not None:
        latest = run_sql(session, target, "SELECT MAX(step) FROM python.torch_trace").rows[0][0]
        if latest is not None:
            rr.modules = _rows(run_sql(session, target, mod_sql.format(f"= {int(latest)}")))
            rr.steps += _rows(run_sql(session, target,
                f"SELECT step, epoch(started_at) AS start, duration, loss, lr FROM torch.steps WHERE step = {int(latest)}"))
            notes.append(f"{target.label}: none of the last {steps} steps was traced (PROBE_TRACE samples steps); "
                         f"included step {int(latest)}, the latest traced one")
        else:
            notes.append(f"{target.label}: no module trace recorded (PROBE_TRACE=off?)")
    if "python.spans" in tables:
        rr.spans = _rows(run_sql(session, target,
            f"SELECT name, step, epoch(time) AS start, duration, depth, parent, thread, thread_id FROM python.spans "
            f"WHERE step {window} ORDER BY time"))
    if "torch.collectives" in tables:
        try:
            rr.collectives = _rows(run_sql(session, target,
                "SELECT pg_desc AS pg, op, seq, state, epoch(COALESCE(started_at, created_at)) AS start, "
                "epoch(completed_at) AS \"end\", step, input_sizes AS sizes FROM torch.collectives "
                f"WHERE step {window} ORDER BY created_at"))
        except ProbeError as exc:  # a recorder table of another shape: the timeline goes on without it
            notes.append(f"{target.label}: collectives left out ({exc.message.rstrip('.')})")
    return rr, notes


@command("trace", "Write a timeline of the last steps (steps, sampled module calls, user spans, collectives) as Chrome trace-event JSON for Perfetto or chrome://tracing.")
class Trace(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--steps", type=int, default=10, help="How many of the latest steps to include (default 10).")
        p.add_argument("-o", "--output", required=True, help="File to write the trace to; - writes it to standard output.")

    def run(self, session, args):
        import json
        import os
        import time

        from .._fanout import check_partial, fan_out
        from .._timeline import build_trace

        if args.steps < 1:
            raise ProbeError("--steps must be at least 1.")
        started = time.perf_counter()
        answers = fan_out(session.targets(), lambda t: _timeline_rows(session, t, args.steps))
        ok = [a.value for a in answers if a.ok]
        if not ok:
            check_partial(answers, "timeline queries")
        doc = build_trace([rr for rr, _ in ok], {"steps": args.steps})
        text = json.dumps(doc, separators=(",", ":"), default=str)
        if args.output == "-":
            session.print(text)
        else:
            path = os.path.abspath(os.path.expanduser(args.output))
            try:
                with open(path + ".tmp", "w") as f:
                    f.write(text)
                os.replace(path + ".tmp", path)
            except OSError as exc:
                raise ProbeError(f"cannot write {args.output} ({exc.strerror}); choose another -o path.") from None
            n = sum(1 for e in doc["traceEvents"] if e["ph"] != "M")
            summary = {"path": path, "ranks": len(ok), "events": n, "bytes": len(text),
                       "seconds": round(time.perf_counter() - started, 3)}
            if session.format == "json":
                session.print(json.dumps(summary))
            else:
                session.print(f"wrote {path}: {n} events from {len(ok)} process{'es' if len(ok) != 1 else ''} "
                              f"in {summary['seconds']:.2f} s; open it at https://ui.perfetto.dev or chrome://tracing.")
        for _, notes in ok:
            for note in notes:
                session.note(f"probe: {note}.")
        check_partial(answers, "timeline queries")
        return 0


@command("profile-steps", "Run torch.profiler over the next N steps of a live job and write its Chrome trace (CPU, and CUDA where used) to a file.")
class ProfileSteps(Command):
    @staticmethod
    def add_arguments(p):
        p.add_argument("steps", type=int, help="How many steps to profile (1-100), starting at the next step boundary.")
        p.add_argument("-o", "--output", required=True, help="File to write the Chrome trace to (open it in Perfetto or chrome://tracing).")
        p.add_argument("--with-stack", action="store_true", help="Record Python stacks of operators (more overhead, larger trace).")
        p.add_argument("--record-shapes", action="store_true", help="Record input shapes of operators.")
        p.add_argument("--wait", type=float, default=600.0, help="Seconds to wait for the N steps to finish (default 600).")

    def run(self, session, args):
        import os
        import time

        from probe._errors import ActionError

        from .actions import POLL, _drive, _failure_text

        target = session.target()
        out = os.path.abspath(os.path.expanduser(args.output))
        if not os.path.isdir(os.path.dirname(out)):
            raise ProbeError(f"cannot write {args.output}: its directory does not exist; choose another -o path.")
        body = {"steps": args.steps, "with_stack": args.with_stack, "record_shapes": args.record_shapes}
        if args.timeout:
            body["timeout"] = args.timeout
        action = _drive(session, "profile-steps", target, body, True)
        if isinstance(action, ProbeError):
            raise action
        if action["state"] != "done":
            raise ActionError(_failure_text(action))
        started = action["result"]
        session.note(f"probe: profiling steps {started['from_step']}-{started['until_step']} "
                     f"({', '.join(started['activities'])}).")
        client = session.client(target)
        deadline = time.monotonic() + args.wait
        while True:
            prof = client.get("/profile-steps", timeout=session.timeout)["profile"]
            if prof.get("action_id") != action["id"]:
                raise ActionError("the process no longer knows this profile (another one replaced it); run profile-steps again.")
            if prof["state"] != "running":
                break
            if time.monotonic() > deadline:
                raise ActionError(f"the {args.steps} steps did not finish within {args.wait:g} s; the trace will be written "
                                  f"to {prof['path']} on the training host when they do.")
            time.sleep(min(POLL / 4, 0.5))  # ok-sleep: polling the profile's state with a deadline
        if prof["state"] != "done":
            raise ActionError(f"the profile failed: {prof.get('error')}.")
        _fetch(session, client, target, prof["path"], out)
        size = os.path.getsize(out)
        if session.format == "json":
            import json

            session.print(json.dumps({**prof, "output": out}, default=str))
        else:
            session.print(f"wrote {out}: torch.profiler trace of steps {prof['from_step']}-{prof['ended_step']} "
                          f"({size / 1e6:.1f} MB, export {prof.get('export_s', 0):.2f} s); open it at https://ui.perfetto.dev.")
        return 0


def _fetch(session, client, target, remote: str, out: str) -> None:
    """Copy the trace: from the runtime directory on this host, else in chunks over the connection."""
    import base64
    import os
    import shutil

    tmp = out + ".tmp"
    try:
        if target.socket and os.path.exists(remote):
            shutil.copyfile(remote, tmp)
        else:
            offset = 0
            with open(tmp, "wb") as f:
                while offset is not None:
                    chunk = client.get("/profile-steps", timeout=session.timeout + 30, file=remote, offset=offset)
                    f.write(base64.b64decode(chunk["data"]))
                    offset = chunk["next"]
        os.replace(tmp, out)
    except OSError as exc:
        raise ProbeError(f"cannot write {out} ({exc.strerror}); choose another -o path.") from None
