"""The query engine shares one DuckDB database per process; each query's snapshots stay its own."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

from probe._errors import QueryError
from probe.sql.engine import execute

COLUMNS = [("a", "BIGINT"), ("s", "VARCHAR")]


def table(values):
    return {"t.x": (COLUMNS, {"a": np.array(values, dtype="i8"), "s": np.array([f"v{v}" for v in values], dtype=object)})}


def test_concurrent_queries_each_read_their_own_snapshot():
    # given: two queries over the same table name, with different data, running at the same time
    slow = "SELECT sum(a) AS total, min(s) AS s FROM t.x, range(20000000)"
    results: dict = {}
    spans: dict = {}
    start = threading.Barrier(2)

    def run(key, values):
        start.wait()
        t0 = time.perf_counter()
        results[key] = execute(slow, table(values), timeout=60).rows
        spans[key] = (t0, time.perf_counter())

    threads = [threading.Thread(target=run, args=("one", [1])), threading.Thread(target=run, args=("two", [2, 3]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # then: neither saw the other's rows
    assert results == {"one": [[20000000, "v1"]], "two": [[100000000, "v2"]]}
    (a0, a1), (b0, b1) = spans["one"], spans["two"]
    assert a0 < b1 and b0 < a1  # they did overlap (DuckDB releases the GIL while it runs)


def test_a_finished_query_keeps_no_snapshot_alive():
    tables = table([5, 6, 7])
    ref = weakref.ref(tables["t.x"][1]["a"])
    assert execute("SELECT count(*) FROM t.x", tables).rows == [[3]]
    del tables
    gc.collect()
    assert ref() is None


def test_a_table_not_given_to_this_query_is_not_readable_from_an_earlier_one():
    execute("SELECT * FROM t.x", table([1]))  # the view t.x now exists in the shared database
    with pytest.raises(QueryError, match="DuckDB refused the query"):
        execute("SELECT * FROM t.x", {})  # but this query registered no data for it


def test_the_configuration_stays_locked():
    with pytest.raises(QueryError, match="configuration"):
        execute("SET threads = 4", {})


def test_a_forked_child_opens_its_own_database():
    import os

    assert execute("SELECT count(*) FROM t.x", table([1, 2])).rows == [[2]]  # the parent's database is open
    pid = os.fork()
    if pid == 0:  # the child: a query must work on a database of its own
        code = 1
        try:
            code = 0 if execute("SELECT sum(a) FROM t.x", table([4, 5])).rows == [[9]] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert execute("SELECT count(*) FROM t.x", table([7])).rows == [[1]]  # the parent's still works
