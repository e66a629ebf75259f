"""What a command runs with: parsed options, resolved targets, a client, output.

Commands and the REPL share it (the REPL's session switches its target); it imports
nothing of the CLI at start-up, so any of them may import it.
"""

from __future__ import annotations

import sys

from probe.config import setting
from probe._errors import ProbeError


class Session:
    """What a command runs with: parsed options, resolved targets, output."""

    def __init__(self, args, stdout=None, stderr=None):
        self.args = args
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.timeout = args.timeout or 10.0
        self.token = args.token or setting("PROBE_TOKEN", strict=True)
        self.format = args.format or "table"
        self.agent: str | None = None  # set by front ends acting for the user (MCP): sent with every request
        self.writes_files = True  # False for a front end that promises to write no files (the MCP read tier)

    def print(self, text: str = "") -> None:
        """``text`` on standard output; control characters a process or endpoint put in it are escaped."""
        from probe.util.printable import terminal_text

        print(terminal_text(text), file=self.stdout, flush=True)

    def note(self, text: str) -> None:
        from probe.util.printable import terminal_text

        print(terminal_text(text), file=self.stderr, flush=True)

    @property
    def multi(self) -> bool:
        return bool(getattr(self.args, "ranks", None))

    def target(self):
        """The single target of this invocation (ENDPOINT or --rank N)."""
        from .endpoint import resolve, targets_for_ranks

        a = self.args
        if getattr(a, "ranks", None):
            raise ProbeError(f"`{a.command}` takes one process here; use --rank N or an ENDPOINT instead of --ranks.")
        if a.endpoint and a.rank is not None:
            raise ProbeError("give either an ENDPOINT or --rank N, not both.")
        if a.rank is not None:
            return targets_for_ranks([a.rank], self.token, getattr(a, "job", None), agent=self.agent)[0]
        if not a.endpoint:
            raise ProbeError(
                f"`probe {a.command}` needs a process: `probe ENDPOINT {a.command}` with a pid, host:port or socket "
                "(see `probe list`), or --rank N."
            )
        return resolve(a.endpoint, self.token, agent=self.agent)

    def targets(self):
        """Every target of this invocation: --ranks SPEC, else the single one."""
        from .endpoint import parse_rank_spec, targets_for_ranks

        if getattr(self.args, "ranks", None):
            if self.args.endpoint or self.args.rank is not None:
                raise ProbeError("give --ranks alone, without an ENDPOINT or --rank.")
            return targets_for_ranks(
                parse_rank_spec(self.args.ranks), self.token, getattr(self.args, "job", None), agent=self.agent
            )
        return [self.target()]

    def computed_table(self, name: str, targets):
        """A table this client computes itself (kind ``client``) for ``targets``, as ``([(column, type)],
        {column: values})``; None for a table the ranks answer. ``diagnosis.findings`` is the doctor's
        findings, made by the same code as ``probe doctor``; ``diagnosis.rules`` adds the rules probe ships,
        which live in this client, to the ones each process serves (its script's own)."""
        if name not in ("diagnosis.findings", "diagnosis.rules"):
            return None
        from ..doctor import findings_table, rules_table

        return (findings_table if name == "diagnosis.findings" else rules_table)(self, targets)

    def client(self, target=None):
        """The client of ``target``: HTTP to its server, or its post-mortem record when it is gone."""
        target = target or self.target()
        from .postmortem import RecordClient, is_postmortem

        if is_postmortem(target):
            return RecordClient(target, timeout=self.timeout, agent=self.agent)
        from .client import Client

        return Client(target, timeout=self.timeout, agent=self.agent)
