"""Federation rewrites as fixture pairs: every query runs whole on DuckDB over all ranks' rows,
and split (per-rank parts on each rank's own DuckDB, unioned with a rank column, then the outer
query); both sides must return the same rows."""

from __future__ import annotations


import pytest

from probe.sql import federate
from probe.sql.engine import Result, connect, register_result

SCHEMA = {
    "torch.steps": {"step": "BIGINT", "duration": "DOUBLE", "loss": "DOUBLE", "rank": "INTEGER"},
    "process.info": {"pid": "BIGINT", "host": "VARCHAR", "rank": "INTEGER"},
}


def rank_rows(rank: int) -> dict:
    steps = [[s, 0.1 + 0.05 * rank + 0.001 * (s % 3), 2.0 / (s + rank + 1), rank] for s in range(1, 9 + rank)]
    return {"torch.steps": steps, "process.info": [[1000 + rank, f"node{rank // 2}", rank]]}


RANKS = (0, 1, 2, 3)

FIXTURES = [
    "SELECT rank, max(step) AS last, count(*) AS n FROM torch.steps GROUP BY rank",
    "SELECT step, duration FROM torch.steps WHERE rank = 3 AND step > 4 AND loss < 1",
    # the cross-rank join from the issue: step times of rank 0 vs rank 3 side by side
    "SELECT a.step, a.duration AS r0, b.duration AS r3 FROM torch.steps a JOIN torch.steps b "
    "ON a.step = b.step AND b.rank = 3 WHERE a.rank = 0 AND a.step >= 2",
    "SELECT s.rank, i.host, avg(s.loss) FROM torch.steps s JOIN process.info i USING (rank) "
    "WHERE i.host = 'node1' GROUP BY ALL",
    "SELECT s.step, i.pid FROM torch.steps s LEFT JOIN process.info i ON i.rank = s.rank AND i.pid > 1001 "
    "WHERE i.pid IS NULL AND s.step < 3",
    "SELECT count(*) FROM torch.steps",
    "SELECT * FROM process.info",
    "WITH recent AS (SELECT rank, step, loss FROM torch.steps WHERE step > 5) "
    "SELECT rank, min(loss) FROM recent WHERE rank <> 1 GROUP BY rank",
    "SELECT rank, step FROM torch.steps t WHERE duration > (SELECT avg(duration) FROM torch.steps) OR step = 1",
    "SELECT step FROM torch.steps WHERE loss > 0.3 UNION SELECT step FROM torch.steps WHERE step = 8",
]


def _load(con, name, cols, rows, rank=None):
    res = Result(list(cols), list(cols.values()), rows)
    raw = f"raw_{name.replace('.', '_')}"
    register_result(con, raw, res)
    schema, short = name.split(".")
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
    con.execute(f"CREATE OR REPLACE VIEW {schema}.{short} AS SELECT * FROM {raw}")


def whole(sql: str) -> list:
    con = connect()
    for name, cols in SCHEMA.items():
        _load(con, name, cols, [r for k in RANKS for r in rank_rows(k)[name]])
    return sorted(map(tuple, con.execute(sql).fetchall()), key=repr)


def split(sql: str) -> list:
    plan = federate.plan(sql, SCHEMA)
    union: dict = {}
    for k in RANKS:
        con = connect()
        for name, cols in SCHEMA.items():
            _load(con, name, cols, rank_rows(k)[name])
        for name, part in plan.parts.items():
            cur = con.execute(part)
            cols = [d[0] for d in cur.description]
            union.setdefault(name, [cols, []])[1].extend([[k, *r] for r in cur.fetchall()])
    client = connect()
    for name, (cols, rows) in union.items():
        order = federate.union_columns(cols, list(SCHEMA[name]))
        full = [dict(zip(["rank", *cols], r)) for r in rows]
        _load(client, name, {c: SCHEMA[name].get(c, "INTEGER") for c in order}, [[r[c] for c in order] for r in full])
    return sorted(map(tuple, client.execute(plan.outer).fetchall()), key=repr)


@pytest.mark.parametrize("sql", FIXTURES)
def test_split_query_returns_the_same_rows(sql):
    expected = whole(sql)
    assert expected, "a fixture must return rows to be a meaningful comparison"
    assert split(sql) == expected


def test_pushdown_projects_and_filters_per_rank():
    # given a query that reads two columns and filters on one table
    plan = federate.plan("SELECT step FROM torch.steps WHERE loss < 1 AND rank = 2", SCHEMA)
    # then the rank part fetches only those columns, filters on loss, and never on the client's rank
    assert plan.parts == {"torch.steps": "SELECT loss, step FROM torch.steps WHERE loss < 1"}


def test_views_pull_the_per_rank_aggregate():
    schema = dict(SCHEMA, **{"torch.process_groups": {"pg": "VARCHAR", "pending_s": "DOUBLE"}})
    plan = federate.plan("SELECT rank FROM ranks.stragglers", schema, {"straggler_factor": 3})
    # stragglers read the one classification (ranks.status), which reads the lined-up collectives
    assert set(plan.parts) == {"ranks.latest", "ranks.issued", "torch.process_groups"}
    assert list(plan.views) == ["ranks.collectives", "ranks.status", "ranks.stragglers"]
    assert "3.0 * m.others" in plan.views["ranks.status"]


def test_unknown_table_is_refused_with_the_known_names():
    from probe import QueryError

    with pytest.raises(QueryError, match="known tables"):
        federate.plan("SELECT * FROM torch.nothing", SCHEMA)
