"""Run the doctor's rules against one process or the ranks of a job; return findings.

The rules are data (``probe.diagnosis``): this module asks which processes answer, reads
what it can from outside for those that do not (the kernel's process state, the hang
watchdog's dump, py-spy's stack), then runs every rule whose tables exist through the
same query path as ``probe query`` (one rank is federation with one rank), and turns
each row into a finding with its message and next commands. Nothing here adds work to
the training processes beyond the queries themselves: the rules read data already kept.
"""

from __future__ import annotations

import json
import math
import string
import time
from dataclasses import dataclass, field

from probe.config import setting
from probe._errors import ProbeError
from probe.diagnosis.rules import SEVERITIES, Rule, all_rules
from probe.util.procfs import proc_state

from .plumbing.fanout import fan_out
from .plumbing.postmortem import is_postmortem

__all__ = ["Finding", "Diagnosis", "diagnose", "fold", "findings_table", "fill_message", "next_commands"]


@dataclass
class Finding:
    rule: str
    family: str
    severity: str
    message: str
    rank: int | None = None
    step: int | None = None
    target: str | None = None
    evidence: dict = field(default_factory=dict)
    next: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "family": self.family,
            "severity": self.severity,
            "rank": self.rank,
            "step": self.step,
            "target": self.target,
            "message": self.message,
            "evidence": self.evidence,
            "next": self.next,
        }

    def to_row(self) -> dict:
        """The finding as a row of ``diagnosis.findings`` (evidence and next as JSON text)."""
        return dict(self.to_dict(), evidence=json.dumps(self.evidence, default=str), next=json.dumps(self.next))


@dataclass
class Diagnosis:
    findings: list
    processes: int
    answering: int
    rules_run: int
    rules_skipped: list
    elapsed: float
    lacking: str = "the process does not have"  # who lacks a table a skipped rule reads (see skipped_lines)

    @property
    def worst(self) -> str | None:
        return min((f.severity for f in self.findings), key=SEVERITIES.index, default=None)

    def skipped_lines(self) -> list:
        """The rules that could not run, one line each, except those that read a table the process (or its
        post-mortem record) lacks: one line for all of them, naming the tables."""
        tables = list(dict.fromkeys(s["table"] for s in self.rules_skipped if s.get("table")))
        lines = [f"{s['rule']}: {s['why']}" for s in self.rules_skipped if not s.get("table")]
        if tables:
            n = sum(1 for s in self.rules_skipped if s.get("table"))
            lines.append(
                f"{n} rule{'s' if n != 1 else ''} read tables {self.lacking}: {', '.join(sorted(tables))} "
                "(--format json names each rule)."
            )
        return lines

    def to_dict(self) -> dict:
        return {
            "findings": [f.to_dict() for f in self.findings],
            "processes": self.processes,
            "answering": self.answering,
            "rules_run": self.rules_run,
            "rules_skipped": self.rules_skipped,
            "elapsed_s": round(self.elapsed, 3),
        }


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def next_commands(templates, row: dict) -> list:
    """The rule's next commands for ``row``; one that names a ``next_*`` column whose value is NULL or
    empty is left out (a rule's SQL says which commands fit what it found).

    >>> next_commands(["probe {target} backtrace", "probe {target} {next_lr}"], {"target": "42", "next_lr": None})
    ['probe 42 backtrace']
    """
    out = []
    for t in templates:
        names = [name for _, name, _, _ in string.Formatter().parse(t) if name]
        if any(n.startswith("next_") and row.get(n) in (None, "") for n in names):
            continue
        out.append(fill_message(t, row))
    return out


def fill_message(template: str, row: dict) -> str:
    """The rule's template with the row's values; a missing, NULL or ill-fitting value prints as '?'.

    Each field is formatted on its own, so one value that does not fit its format spec
    (a NULL where ``{ratio:.2f}`` expects a number) costs that field, never the finding.

    >>> fill_message("{a:.2f} of {b} ({c:.0%})", {"a": 1.234, "b": None})
    '1.23 of ? (?)'
    """
    out = []
    for literal, name, spec, conv in string.Formatter().parse(template):
        out.append(literal)
        if name is None:
            continue
        value = row.get(name)
        if value is None:
            out.append("?")
            continue
        try:
            if conv:
                value = {"r": repr, "s": str, "a": ascii}[conv](value)
            out.append(format(value, spec))
        except (ValueError, TypeError, KeyError):
            out.append(str(value))
    return "".join(out)


def _where(session, rank) -> str:
    """What to type after ``probe`` to reach the process a finding is about."""
    if session.multi and rank is not None:
        return f"--rank {rank}"
    args = session.args
    if getattr(args, "endpoint", None):
        return str(args.endpoint)
    if getattr(args, "rank", None) is not None:
        return f"--rank {args.rank}"
    return str(rank)


def _outside(target, error: str) -> Finding:
    """A process that does not answer: what the kernel, the hang dump and py-spy say."""
    from probe._runtime import offline_status

    pid = target.local_pid
    facts, evidence = [], {"error": error}
    state = proc_state(pid) if pid is not None else None
    if pid is not None:
        evidence["proc_state"] = state
        if state in ("T", "t"):
            facts.append(f"it is stopped (SIGSTOP or a debugger); `kill -CONT {pid}` resumes it")
        elif state is None or state == "Z":
            facts.append("it has exited")
    dump = offline_status(target.entry) if target.entry else {}
    if dump.get("hang_dump"):
        evidence.update(dump)
        facts.append(f"its hang watchdog fired (stacks in {dump['hang_dump']})")
    if pid is not None and state not in (None, "Z", "T", "t"):
        try:
            from probe.injector import pyspy_backtrace

            from .stacks import main_thread, user_frame

            doc = pyspy_backtrace(pid, timeout=5.0)
            frames = (main_thread(doc) or {}).get("frames") or []
            if frames:
                top = frames[0]
                user = user_frame(frames) or top
                evidence["main_thread"] = frames[:8]
                facts.append(
                    f"py-spy shows its main thread in {top.get('func')} ({top.get('file')}:{top.get('lineno')})"
                    + (
                        f", called from {user.get('func')} ({user.get('file')}:{user.get('lineno')})"
                        if user is not top
                        else ""
                    )
                    + ": a thread is probably holding the GIL in a C call"
                )
        except ProbeError as exc:
            facts.append(f"py-spy could not read it ({exc.message.rstrip('.')})")
    message = (
        f"{target.label} is not answering ({error.rstrip('.')})" + ("; " + "; ".join(facts) if facts else "") + "."
    )
    next_steps = [f"probe {pid} backtrace --native"] if pid is not None and state not in (None, "Z") else []
    return Finding(
        "not_answering",
        "hang",
        "critical",
        message,
        rank=target.rank,
        target=target.label,
        evidence=evidence,
        next=next_steps,
    )


def _user_rules(con, builtin_names: set) -> list:
    """Rules the training script declared itself (listed in its diagnosis.rules table)."""
    from .query_runner import run_outer

    res = run_outer(
        con,
        "SELECT DISTINCT name, family, severity, description, sql, message, next, scope, params, explains "
        "FROM diagnosis.rules",
        1000,
    )
    out = []
    for row in res.rows:
        d = dict(zip(res.columns, row))
        if d["name"] in builtin_names:
            continue
        try:
            d["next"] = json.loads(d["next"] or "[]")
            d["params"] = json.loads(d["params"] or "{}")
            d["explains"] = json.loads(d["explains"] or "[]")
            out.append(Rule.from_dict(d))
        except (ValueError, TypeError, KeyError):
            continue
    return out


def _plans(rules: list, schema: dict, answering: int, lacking: str, write: bool = True):
    """``[(rule, plan)]`` for the rules that can run here, and ``[{rule, why}]`` for the rest (with ``table``
    when the rule reads a table that ``lacking`` names the owner of); the plans are cached in the runtime
    directory, or in memory only when ``write`` is false."""
    from probe.sql.federate import plan
    from probe.sql.plan_cache import PlanCache
    from probe.sql.ranks import view_params

    params = view_params(strict=True)
    cache = PlanCache(schema, params, write=write)  # the same rules over the same tables plan the same: once
    plans, skipped = [], []
    for r in rules:
        if r.scope == "job" and answering < 2:
            continue
        sql = r.sql
        try:
            if r.params:
                sql = sql.format(**{k: setting(name, strict=True) for k, name in r.params})
            p = cache.get(sql)
            if p is None:
                p = plan(sql, schema, params)
                cache.put(sql, p)
            if "diagnosis.findings" in p.parts:
                skipped.append({"rule": r.name, "why": "it reads diagnosis.findings, which the doctor itself makes"})
                continue
            plans.append((r, p))
        except ProbeError as exc:
            table = getattr(exc, "table", None)
            if table:
                skipped.append({"rule": r.name, "why": f"it reads {table}, which {lacking}", "table": table})
            else:
                skipped.append({"rule": r.name, "why": exc.message})
    cache.save()
    return plans, skipped


def diagnose(session, targets=None) -> Diagnosis:
    """Every rule against the session's target(s) (or ``targets``); the findings most severe first.

    Each table a rule reads is fetched once from every answering process (whole, so one
    snapshot serves every rule); the rules then run here, in one private DuckDB database.
    """
    from probe.sql.federate import per_rank_query
    from probe.sql.ranks import FEDERATED_VIEWS

    from .query_runner import fetch_schema, materialize_views, open_database, run_outer

    started = time.perf_counter()
    targets = session.targets() if targets is None else targets
    health = fan_out(targets, lambda t: session.client(t).get("/health", timeout=min(session.timeout, 3.0)))
    findings = [_outside(a.target, a.error) for a in health if not a.ok]
    answering = [a.target for a in health if a.ok]
    skipped, run, rules = [], 0, []
    lacking = (
        "the post-mortem record does not keep"
        if answering and all(is_postmortem(t) for t in answering)
        else "the process does not have"
        if len(answering) == 1
        else "the processes do not have"
    )
    if answering:
        schema = fetch_schema(session, answering)
        rules = all_rules()
        if "diagnosis.rules" in schema:  # the script's own rules first: they may read other tables
            con, _ = open_database(
                session,
                answering[:1],
                schema,
                {
                    "diagnosis.rules": per_rank_query(
                        "diagnosis.rules", [c for c in schema["diagnosis.rules"] if c != "rank"], None
                    )
                },
            )
            try:
                rules += _user_rules(con, {r.name for r in rules})
            finally:
                con.close()
        plans, skipped = _plans(rules, schema, len(answering), lacking, write=session.writes_files)
        needed = {name for _, p in plans for name in p.parts}
        parts = {
            name: " ".join(FEDERATED_VIEWS[name].split())
            if name in FEDERATED_VIEWS
            else per_rank_query(name, [c for c in schema[name] if c != "rank"], None)
            for name in needed
        }
        con, _ = open_database(session, answering, schema, parts)
        made: dict = {}  # client views already created (the ranks.* views are the same for every rule)
        try:
            for r, p in plans:
                try:
                    materialize_views(con, {k: v for k, v in p.views.items() if made.get(k) != v})  # once for all rules
                    made.update(p.views)
                    res = run_outer(con, p.outer, 1000)
                except ProbeError as exc:
                    skipped.append({"rule": r.name, "why": exc.message})
                    continue
                except Exception as exc:  # a view DuckDB refuses (e.g. a user's rule): that rule only
                    skipped.append({"rule": r.name, "why": f"{type(exc).__name__}: {exc}"})
                    continue
                run += 1
                for row in res.rows:
                    d = {c: _clean(v) for c, v in zip(res.columns, row)}
                    rank = d.get("rank")
                    where = _where(session, rank)
                    fields = dict(d, target=where)
                    findings.append(
                        Finding(
                            r.name,
                            r.family,
                            r.severity,
                            fill_message(r.message, fields),
                            rank=rank,
                            step=d.get("step"),
                            target=where,
                            evidence=d,
                            next=next_commands(r.next, fields),
                        )
                    )
        finally:
            con.close()
    findings = fold(findings, {r.name: r.explains for r in rules if r.explains})
    # within a family and rank, the finding with the earliest step first: the cause before its consequences
    findings.sort(
        key=lambda f: (
            SEVERITIES.index(f.severity),
            f.family,
            f.rank if f.rank is not None else -1,
            f.step is None,
            f.step or 0,
        )
    )
    return Diagnosis(findings, len(targets), len(answering), run, skipped, time.perf_counter() - started, lacking)


def fold(findings: list, explains: dict) -> list:
    """Fold the findings a rule explains into that rule's finding: a job whose ranks all wait in mismatched
    collectives is one finding, not one more per rank that no step completes on. The folded ones are named at
    the end of its message and kept whole in its evidence (``explains``).

    >>> cause = Finding("collective_mismatch", "distributed", "critical", "rank 1 left the path.")
    >>> hung = [Finding("hung", "hang", "critical", "no step for 70 s.", rank=r) for r in (0, 1, 2)]
    >>> other = Finding("loss_spike", "divergence", "warning", "a spike.", rank=0)
    >>> [f.rule for f in fold([cause, *hung, other], {"collective_mismatch": ("hung",)})]
    ['collective_mismatch', 'loss_spike']
    >>> cause.message
    'rank 1 left the path. It explains: hung on ranks 0, 1, 2.'
    """
    causes = [f for f in findings if explains.get(f.rule)]
    if not causes:
        return findings
    folded: set = set()
    for cause in causes:
        effects = [f for f in findings if f.rule in explains[cause.rule] and f is not cause and id(f) not in folded]
        if not effects:
            continue
        folded.update(id(f) for f in effects)
        said = []
        for rule in dict.fromkeys(f.rule for f in effects):
            ranks = sorted({f.rank for f in effects if f.rule == rule and f.rank is not None})
            said.append(
                rule + (f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "")
            )
        cause.message += f" It explains: {'; '.join(said)}."
        cause.evidence = dict(cause.evidence, explains=[f.to_dict() for f in effects])
    return [f for f in findings if id(f) not in folded]


def findings_table(session, targets) -> tuple:
    """``diagnosis.findings`` for ``targets``: ``([(column, type)], {column: values})``, by the doctor's own code."""
    from probe.tables.diagnosis import FINDING_COLUMNS

    rows = [f.to_row() for f in diagnose(session, targets).findings]
    return [(c.name, c.type) for c in FINDING_COLUMNS], {c.name: [r[c.name] for r in rows] for c in FINDING_COLUMNS}
