"""Run the doctor's rules against one process or the ranks of a job; return findings.

The rules are data, declared with ``probe.diagnosis.rules.rule``: the ones probe ships live in this
package's modules (``BUILTIN``), loaded into this client's registry on first use and never into a training
process, which serves only its script's own rules (the ``diagnosis.rules`` table). This module asks which
processes answer, reads what it can from outside for those that do not (the kernel's process state, the hang
watchdog's dump, py-spy's stack), then runs every rule whose tables exist through the same query path as
``probe query`` (one rank is federation with one rank), and turns each row into a finding (``findings``).
Nothing here adds work to the training processes beyond the queries themselves: the rules read data already kept.
"""

from __future__ import annotations

import importlib
import json
import math
import time

from probe.config import setting
from probe._errors import ProbeError
from probe.diagnosis import rules as registry
from probe.diagnosis.rules import SEVERITIES, Rule
from probe.util.procfs import proc_state

from ..plumbing.fanout import fan_out
from ..plumbing.postmortem import is_postmortem
from .findings import Diagnosis, Finding, fill_message, fold, next_commands

__all__ = [
    "Finding",
    "Diagnosis",
    "diagnose",
    "fold",
    "findings_table",
    "fill_message",
    "next_commands",
    "rules_table",
    "all_rules",
    "get_rule",
    "BUILTIN",
]

# the modules of this package that declare the built-in rules: one process's training (hangs, NaNs, the loss),
# what trains (parameters, gradients, replicas), memory/speed/input/activations, the invariant checks of
# torch.checks, the batch, update and loss-scaling signals, and across ranks
BUILTIN = ("process", "params", "runtime", "invariants", "signals", "ranks")
_LOADED: list[bool] = []


def all_rules() -> list[Rule]:
    """Every rule this client knows: the built-ins (imported once) and any declared here, most severe first."""
    if not _LOADED:
        for mod in BUILTIN:
            importlib.import_module(f"{__name__}.{mod}")  # each declares its rules with ``rule(...)``
        _LOADED.append(True)
    return registry.all_rules()


def get_rule(name: str) -> Rule | None:
    all_rules()
    return registry.get_rule(name)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


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

            from ..stacks import main_thread, user_frame

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


def _own_rules(session, target, schema: dict) -> list:
    """The rules the training script declared itself (its ``diagnosis.rules`` table), one dict per rule with its
    ``rank``, the JSON columns as text; none where the process lists no such table. Read from its snapshot as is: a
    few rows that need no DuckDB workspace of their own."""
    if "diagnosis.rules" not in schema:
        return []
    columns = [c for c in schema["diagnosis.rules"] if c != "rank"]
    answer = session.client(target).snapshot({"diagnosis.rules": {"columns": columns, "filter": None}}, session.timeout)
    rank = target.rank if target.rank is not None else answer.get("meta", {}).get("rank")
    table = answer["tables"].get("diagnosis.rules") or {"rows": 0, "columns": {}}
    values = {}
    for name, col in table["columns"].items():
        data = col["data"].tolist()
        valid = col["valid"]
        values[name] = data if valid is None else [v if ok else None for v, ok in zip(data, valid.tolist())]
    rows = [
        {**{c: values[c][i] if c in values else None for c in columns}, "rank": rank} for i in range(int(table["rows"]))
    ]
    return [dict(t) for t in dict.fromkeys(tuple(r.items()) for r in rows)]  # distinct, in their order


def _as_rule(d: dict) -> Rule | None:
    try:
        return Rule.from_dict(
            dict(
                d,
                next=json.loads(d["next"] or "[]"),
                params=json.loads(d["params"] or "{}"),
                explains=json.loads(d["explains"] or "[]"),
            )
        )
    except (ValueError, TypeError, KeyError):
        return None


def _plans(rules: list, schema: dict, answering: int, lacking: str, write: bool = True):
    """``[(rule, plan)]`` for the rules that can run here, ``[{rule, why}]`` for the rest (with ``table``
    when the rule reads a table that ``lacking`` names the owner of), and the cache of those plans (in the runtime
    directory, or in memory only when ``write`` is false: the caller saves it)."""
    from probe.sql.plan_cache import PlanCache
    from probe.sql.ranks import view_params

    params = view_params(strict=True)
    # the same rules over the same tables plan the same: once
    cache = PlanCache(schema, params, store="file" if write else "read")
    plans, skipped = [], []
    for r in rules:
        if r.scope == "job" and answering < 2:
            continue
        sql = r.sql
        try:
            if r.params:
                sql = sql.format(**{k: setting(name, strict=True) for k, name in r.params})
            p = cache.plan(sql)
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
    return plans, skipped, cache


def diagnose(session, targets=None) -> Diagnosis:
    """Every rule against the session's target(s) (or ``targets``); the findings most severe first.

    Each table a rule reads is fetched once from every answering process (whole, so one
    snapshot serves every rule); the rules then run here, in one private DuckDB database.
    """
    from probe.sql.federate import per_rank_query
    from probe.sql.ranks import FEDERATED_VIEWS

    from ..query_runner import fetch_schema, materialize_views, open_database, run_outer

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
        builtin = {r.name for r in rules}  # a script's rule of the same name does not replace probe's
        own = {d["name"]: _as_rule(d) for d in _own_rules(session, answering[0], schema) if d["name"] not in builtin}
        rules += [r for r in own.values() if r is not None]
        plans, skipped, cache = _plans(rules, schema, len(answering), lacking, write=session.writes_files)
        needed = {name for _, p in plans for name in p.parts}
        parts = {
            name: " ".join(FEDERATED_VIEWS[name].split())
            if name in FEDERATED_VIEWS
            else per_rank_query(name, [c for c in schema[name] if c != "rank"], None)
            for name in needed
        }
        requests = cache.requests(parts)
        cache.save()
        # every rule reads the same snapshot: each part is computed once into a table, not once per rule reading it
        con, _ = open_database(session, answering, schema, parts, requests=requests, materialize=True)
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


def findings_table(session, targets) -> tuple:
    """``diagnosis.findings`` for ``targets``: ``([(column, type)], {column: values})``, by the doctor's own code."""
    from probe.tables.diagnosis import FINDING_COLUMNS

    rows = [f.to_row() for f in diagnose(session, targets).findings]
    return [(c.name, c.type) for c in FINDING_COLUMNS], {c.name: [r[c.name] for r in rows] for c in FINDING_COLUMNS}


def rules_table(session, targets) -> tuple:
    """``diagnosis.rules`` for ``targets``: the rules probe ships (declared here, ``rank`` NULL) and each
    process's own (which it serves itself), as ``findings_table`` returns them."""
    from probe.tables.diagnosis import rules as rows_of  # the table's own generator makes the built-ins' rows

    from ..query_runner import fetch_schema

    schema = fetch_schema(session, targets)
    columns = list(schema["diagnosis.rules"].items())
    if "rank" not in schema["diagnosis.rules"]:
        columns.append(("rank", "INTEGER"))
    all_rules()  # the built-ins, into this client's registry
    names = [c for c, _ in columns if c != "rank"]
    builtin = [dict(zip(names, row), rank=None) for row in rows_of(None)]
    known = {d["name"] for d in builtin}
    own = [d for t in targets for d in _own_rules(session, t, schema) if d["name"] not in known]
    return columns, {c: [d.get(c) for d in builtin + own] for c, _ in columns}
