"""What the doctor's tests share: run `probe doctor -f json` and poll it until a rule shows, and the
planted-fault test body (tests/test_doctor_faults_*.py split the catalog so xdist runs them side by side)."""

from __future__ import annotations

import json

from conftest import TARGETS, poll
from harness import share_doctor_plans
from targets.fault_catalog import NOT_ALSO, plant

FOUND_EXIT = 8

# A healthy job is held to every rule about what training computes (its data too: same_batch,
# single_class_batches); the rules about the job's speed (slow, input_bound, data_spans) and its pace (stalled: no
# step for 50x its p99) read the host's load on this shared 2-core machine (a 10 ms sleep a step counts as time
# outside the model, so does the time the thread waits for a CPU, and a starved process can go 10 s without a
# step): their healthy controls are in their own tests.
HOST_FAMILIES = ("slow",)
HOST_RULES = ("stalled", "input_bound", "data_spans")


def above_info(findings) -> list:
    """The findings above info, but those of the rules that read the host's load (``HOST_FAMILIES``, ``HOST_RULES``)."""
    return [
        f
        for f in findings
        if f["severity"] in ("critical", "warning")
        and f.get("family") not in HOST_FAMILIES
        and f["rule"] not in HOST_RULES
    ]


def doctor(cli, target, *extra, env=None):
    runtime_dir = {**getattr(cli, "env", {}), **(env or {})}.get("PROBE_RUNTIME_DIR")
    if runtime_dir:
        share_doctor_plans(runtime_dir, give=True)
    r = cli(str(target), "doctor", "-f", "json", *extra, env=env, timeout=180)  # a deadline: see conftest._cli_runner
    if runtime_dir:
        share_doctor_plans(runtime_dir, give=False)
    assert r.returncode in (0, FOUND_EXIT), r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    assert (r.returncode == FOUND_EXIT) == any(f["severity"] in ("critical", "warning") for f in doc["findings"])
    return doc


def find(cli, target, rule, env=None):
    """Run the doctor once, on a target already driven to the state where ``rule`` must speak (a ready line, a
    step it printed); return (that finding, all findings)."""
    doc = doctor(cli, target, env=env)
    hit = [f for f in doc["findings"] if f["rule"] == rule]
    assert hit, f"{rule} not found; the doctor said: {json.dumps(doc['findings'], indent=1)}"
    return hit[0], doc["findings"]


def poll_for(cli, target, rule, timeout=60.0, env=None, interval=2.0):
    """Run the doctor until ``rule`` is among its findings; return (that finding, all findings). Only for rules
    that wait on wall time (a hang: no step for PROBE_HUNG_AFTER seconds); the others use ``find``. Every 2 s:
    those rules wait for seconds, and each doctor run is ~0.8 s of CPU the job and the suite's other jobs share."""
    said = {}

    def hit() -> list:
        said.update(doctor(cli, target, env=env))
        return [f for f in said["findings"] if f["rule"] == rule]

    found = poll(hit, timeout, interval=interval)
    assert found, f"{rule} not found; the doctor said: {json.dumps(said['findings'], indent=1)}"
    return found[0], said["findings"]


def names_the_planted_fault(spawn, cli, fault, rule, words, *, human: bool = False):
    """``human``: also check the human form (one fault a file: it renders every finding alike, and a doctor run
    is ~0.8 s of CPU the suite's other jobs share)."""
    # given: a job with one planted fault, past the point where it shows
    args, env = plant(fault)
    job = spawn([TARGETS / "faults.py", *args], env=env, ready="planted", timeout=180)
    # when: asked once the target reports the fault has had its steps to show (a state, not a time: no polling)
    finding, findings = find(cli, job.pid, rule)
    # then: named with its evidence and a next command to type
    assert finding["severity"] in ("critical", "warning")
    assert sum(f["rule"] == rule for f in findings) == 1, findings  # the culprit alone, not what it feeds
    assert not any(f["rule"] in NOT_ALSO.get(fault, ()) for f in findings), findings
    for w in words:
        assert w in finding["message"], finding
    assert finding["next"] and all(n.startswith("probe ") for n in finding["next"])
    assert str(job.pid) in " ".join(finding["next"])
    if not human:
        return
    # the human form: the most severe finding comes first, with its next command
    text = cli(job.pid, "doctor")
    assert text.returncode == FOUND_EXIT and "next: probe" in text.stdout, (text.returncode, text.stdout, text.stderr)


def rule_rows(name: str, tables: dict, *, messages: bool = False) -> list:
    """Rule ``name``'s SQL on a fresh DuckDB over hand-made tables, for conditions no CPU job here reaches.

    ``tables`` maps ``schema.table`` to ``(column definitions, rows)`` or to a SELECT that builds it.
    Returns the rule's rows as dicts, or with ``messages`` the messages the doctor would print.
    """
    import duckdb

    from probe.cli.doctor import fill_message
    from probe.cli.doctor import get_rule

    rule = get_rule(name)
    con = duckdb.connect()
    for schema in sorted({t.split(".")[0] for t in tables}):
        con.execute(f"CREATE SCHEMA {schema}")
    for table, spec in tables.items():
        if isinstance(spec, str):
            con.execute(f"CREATE TABLE {table} AS {spec}")
            continue
        columns, rows = spec
        con.execute(f"CREATE TABLE {table} ({columns})")
        if rows:
            con.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
    cur = con.execute(rule.sql)
    found = [dict(zip([d[0] for d in cur.description], row)) for row in cur.fetchall()]
    return [fill_message(rule.message, row) for row in found] if messages else found
