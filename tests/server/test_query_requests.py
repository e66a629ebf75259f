"""What a query costs the processes it reads: one request per rank, however many queries a client runs.

A long-lived client (the REPL, the web page, the MCP server) plans with the schema it cached
from an earlier query of the same process; every snapshot says which process and schema
version it comes from, so a table registered since is still found. The requests are counted
by the targets' own servers (``/health``), through the real client, against real processes.
"""

from __future__ import annotations

import pytest

from conftest import TARGETS

JOB = {"WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": "requests-test"}


@pytest.fixture(scope="module")
def ranks(shared_spawn, shared_env):
    return [shared_spawn(TARGETS / "idle.py", env=dict(JOB, RANK=str(r), LOCAL_RANK=str(r))) for r in range(3)]


@pytest.fixture
def session(shared_env, monkeypatch):
    """The CLI's own session and client in this process, as the REPL holds them between queries."""
    from probe.cli.query_runner import forget_schemas
    from probe.cli.plumbing.main import build_parser
    from probe.cli.commands import load_all
    from probe.cli.plumbing.session import Session

    monkeypatch.setenv("PROBE_RUNTIME_DIR", shared_env["PROBE_RUNTIME_DIR"])
    forget_schemas()
    load_all()
    parser, _ = build_parser()
    yield Session(parser.parse_args(["--ranks", "all", "query", "SELECT 1"]))
    forget_schemas()


def served(session) -> dict:
    """Requests each rank's server answered so far, this reading included."""
    return {t.rank: session.client(t).get("/health")["requests"]["unix"] for t in session.targets()}


def test_a_query_over_every_rank_costs_each_rank_one_request(ranks, session):
    from probe.cli.query_runner import federated_query

    sql = "SELECT count(*) AS ranks, count(DISTINCT pid) AS pids FROM process.info"
    assert federated_query(session, sql).rows == [[3, 3]]  # the first query also asks for the tables
    before = served(session)
    for _ in range(3):
        assert federated_query(session, sql).rows == [[3, 3]]
    after = served(session)
    assert {r: after[r] - before[r] for r in after} == {0: 4, 1: 4, 2: 4}  # 3 snapshots and the /health reading


def test_status_asks_each_rank_once(ranks, session):
    from probe.cli.query_runner import federated_query
    from probe.cli.commands.status import SQL

    federated_query(session, SQL)
    before = served(session)
    result = federated_query(session, SQL)
    after = served(session)
    assert [r[0] for r in result.rows] == [0, 1, 2]
    assert {r: after[r] - before[r] for r in after} == {0: 2, 1: 2, 2: 2}


def test_a_table_registered_after_the_schema_was_cached_is_found(ranks, session, shared_cli):
    from probe.cli.query_runner import federated_query

    target = [t for t in session.targets() if t.rank == 1]
    assert federated_query(session, "SELECT count(*) FROM python.threads", targets=target).rows[0][0] >= 2
    # when: the process registers a table after the client cached its schema
    code = (
        "import probe\n"
        "probe.table('test.extra', 'A table added while the process runs.', "
        "columns=[probe.Column('x', 'BIGINT', 'A number.')])(lambda ctx: {'x': [41, 42]})"
    )
    r = shared_cli(ranks[1].pid, "eval", code)
    assert r.returncode == 0, r.stderr
    # then: the next query of the same client sees it, and the one after costs one request again
    assert federated_query(session, "SELECT sum(x) FROM test.extra", targets=target).rows == [[83]]
    before = served(session)[1]
    assert federated_query(session, "SELECT max(x) FROM test.extra", targets=target).rows == [[42]]
    assert served(session)[1] - before == 2
