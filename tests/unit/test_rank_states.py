"""The one classification of rank states (``ranks.status``) and the doctor's rules that read it, on DuckDB over
hand-made ``ranks.latest`` rows: a stall judged against the job's own pace, and the ranks named in words that agree
with their number."""

from __future__ import annotations

import duckdb

from probe.cli.doctor import fill_message, get_rule
from probe.sql.rank_columns import VIEW_COLUMNS
from probe.sql.ranks import view_sql

_GROUPS = (
    "rank INTEGER, pg VARCHAR, pg_desc VARCHAR, last_enqueued BIGINT, last_completed BIGINT, pending INTEGER, "
    "pending_seq BIGINT, pending_op VARCHAR, pending_sizes VARCHAR, pending_dtypes VARCHAR, pending_s DOUBLE, "
    "pending_site VARCHAR"
)


def _rank(rank, age_s, *, waits=False, main_state="sleeping", p99=0.03) -> dict:
    """A rank's ranks.latest row: ``age_s`` since its last step (step 100), 20 ms steps; ``waits``: inside
    all_reduce seq 7."""
    return {
        "rank": rank,
        "pid": 1000 + rank,
        "host": "h",
        "step": 100,
        "age_s": age_s,
        "step_time": 0.02,
        "steps_seen": 100,
        "state": "training",
        "top_frame": "all_reduce (distributed_c10d.py:1)" if waits else "read_batch (train.py:9)",
        "in_collective": waits,
        "recorder": True,
        "pending_op": "all_reduce" if waits else None,
        "pending_seq": 7 if waits else None,
        "pending_s": age_s if waits else None,
        "source": "live",
        "p99": p99,
        "main_state": main_state,
    }


def _database(latest: list) -> duckdb.DuckDBPyConnection:
    """ranks.latest, ranks.issued and torch.process_groups from ``latest``, and the client views over them."""
    con = duckdb.connect()
    for schema in ("ranks", "torch", "python"):
        con.execute(f"CREATE SCHEMA {schema}")
    for name in ("ranks.latest", "ranks.issued"):
        cols = VIEW_COLUMNS[name]
        con.execute(f"CREATE TABLE {name} ({', '.join(f'{c} {t}' for c, t, _ in cols)})")
    names = [c for c, _, _ in VIEW_COLUMNS["ranks.latest"]]
    for row in latest:
        con.execute(f"INSERT INTO ranks.latest VALUES ({', '.join('?' * len(names))})", [row.get(c) for c in names])
    con.execute(
        "CREATE TABLE python.backtrace (rank INTEGER, func VARCHAR, file VARCHAR, lineno INTEGER, is_main BOOLEAN, "
        "depth INTEGER)"
    )
    con.execute(f"CREATE TABLE torch.process_groups ({_GROUPS})")
    for row in latest:  # the waiting ranks issued seq 7; the others stopped at 6
        waits = row["in_collective"]
        con.execute(
            "INSERT INTO torch.process_groups VALUES (?, '0', 'default_pg', ?, 6, ?, ?, ?, '[[10]]', '[Float]', ?, "
            "'train.py:20')",
            [row["rank"], 7 if waits else 6, int(waits), row["pending_seq"], row["pending_op"], row["pending_s"]],
        )
    for view in ("ranks.collectives", "ranks.status", "ranks.hung"):
        con.execute(f"CREATE VIEW {view} AS {view_sql(view, {'hung_after': 600})}")
    return con


def _status(con) -> dict:
    cur = con.execute("SELECT rank, state, culprit, reason FROM ranks.status ORDER BY rank")
    return {r[0]: {"state": r[1], "culprit": r[2], "reason": r[3]} for r in cur.fetchall()}


def _said(con, rule: str) -> list:
    r = get_rule(rule)
    cur = con.execute(r.sql)
    return [fill_message(r.message, dict(zip([d[0] for d in cur.description], row))) for row in cur.fetchall()]


def test_a_lone_process_is_stalled_after_its_own_pace_and_training_before():
    # 20 s without a step at 30 ms p99 steps, main thread asleep: stalled, long before PROBE_HUNG_AFTER (600 s)
    con = _database([_rank(0, 20.0)])
    (row,) = _status(con).values()
    assert row["state"] == "stalled" and not row["culprit"], row
    assert row["reason"] == "no step for 20.0 s, 667x the job's p99 step time of 30.0 ms, outside any collective"
    (said,) = _said(con, "stalled")
    assert said.startswith("no step for 20.0 s since step 100, 667x this job's own p99 step time (30.0 ms;"), said
    # a main thread that runs computes (or waits for a CPU): not stalled; nor is a pause within the pace
    for rank in (_rank(0, 20.0, main_state="running"), _rank(0, 5.0)):
        con = _database([rank])
        assert [r["state"] for r in _status(con).values()] == ["training"]
        assert _said(con, "stalled") == []


def test_the_stalled_rank_is_named_to_the_one_rank_that_waits_for_it():
    # rank 0 waits in all_reduce seq 7, which rank 1 (asleep in its data read) has not issued
    con = _database([_rank(0, 20.0, waits=True), _rank(1, 20.0)])
    rows = _status(con)
    assert rows[0]["state"] == "waiting" and rows[0]["reason"] == "waits in all_reduce seq 7 for rank 1", rows
    assert rows[1]["state"] == "stalled" and rows[1]["culprit"], rows
    assert rows[1]["reason"].startswith("rank 0 waits for it; no step for 20.0 s, 667x the job's p99"), rows
    (said,) = _said(con, "stalled_rank")
    assert said.startswith("rank 1 stalls the job: rank 0 has waited 20.0 s (667x the job's p99 step time"), said
    assert _said(con, "stalled") == [] and _said(con, "hung_rank") == []


def test_several_ranks_are_named_in_the_plural():
    con = _database([_rank(0, 20.0, waits=True), _rank(1, 20.0), _rank(2, 20.0, waits=True)])
    rows = _status(con)
    assert rows[1]["reason"].startswith("ranks 0,2 wait for it; "), rows
    (said,) = _said(con, "stalled_rank")
    assert said.startswith("rank 1 stalls the job: ranks 0,2 have waited 20.0 s"), said
