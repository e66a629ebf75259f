"""The client's query engine and the snapshot form: DuckDB over columns a process handed over.

The snapshot side (``probe.agent.snapshot``, ``probe.util.wire``) is exercised here without a
process: encode, filter, decode, then DuckDB; every pushed-down filter must leave the
query's answer unchanged (fixture pairs: with and without the filter).
"""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest

from probe import QueryError
from probe.agent.snapshot import apply_filter
from probe.util.wire import decode, encode
from probe.sql.engine import Workspace, execute
from probe.sql.pushdown import filter_tree, rename_tables_sql

import sqlglot

COLUMNS = [("a", "BIGINT"), ("s", "VARCHAR")]


def table(values):
    return {
        "t.x": (COLUMNS, {"a": np.array(values, dtype="i8"), "s": np.array([f"v{v}" for v in values], dtype=object)})
    }


def test_a_finished_query_keeps_no_snapshot_alive():
    tables = table([5, 6, 7])
    ref = weakref.ref(tables["t.x"][1]["a"])
    assert execute("SELECT count(*) FROM t.x", tables).rows == [[3]]
    del tables
    gc.collect()
    assert ref() is None


def test_the_configuration_stays_locked():
    with pytest.raises(QueryError, match="configuration"):
        execute("SET threads = 4", {})


def test_a_runaway_query_stops_at_its_timeout():
    with pytest.raises(QueryError, match="timeout"):
        execute(
            "SELECT count(*) FROM range(1000000000) a, range(1000000) b WHERE a.range + b.range < 0", {}, timeout=0.5
        )


def test_the_row_cap_marks_the_result_truncated():
    r = execute("SELECT * FROM range(50)", {}, max_rows=10)
    assert len(r.rows) == 10 and r.truncated


def test_a_cancel_from_another_thread_stops_the_query():
    import threading

    with Workspace() as ws:
        threading.Timer(0.3, ws.interrupt).start()
        with pytest.raises(QueryError, match="cancelled"):
            ws.execute(
                "SELECT count(*) FROM range(1000000000) a, range(1000000) b WHERE a.range + b.range < 0", timeout=60
            )


# -- the snapshot form ------------------------------------------------------------------

SNAP_COLUMNS = [
    ("step", "BIGINT"),
    ("loss", "DOUBLE"),
    ("module", "VARCHAR"),
    ("at", "TIMESTAMP"),
    ("flag", "BOOLEAN"),
    ("n", "BIGINT"),
]


def snapshot_data():
    """A ring-like table (numpy columns) with NaN and missing floats, NULLs in object columns and odd strings."""
    n = 40
    return {
        "step": np.arange(n, dtype="i8"),
        "loss": np.ma.masked_array(
            [math.nan if i % 7 == 0 else math.inf if i == 9 else 1.0 / (i + 1) for i in range(n)],
            mask=[i % 11 == 0 for i in range(n)],
        ),  # NaN and Inf are values, masked is missing
        "module": np.array(
            [None if i % 5 == 0 else ("encoder.läyer" if i % 2 else "head\n'x'") for i in range(n)], dtype=object
        ),
        "at": np.array([1.7e9 + i for i in range(n)]),
        "flag": np.array([i % 3 == 0 for i in range(n)]),
        "n": np.array([None if i % 4 == 0 else i * 10 for i in range(n)], dtype=object),
    }


def roundtrip(data, flt=None):
    types = dict(SNAP_COLUMNS)
    if flt is not None:
        mask = apply_filter(data, types, flt, len(data["step"]))
        idx = np.flatnonzero(mask)
        data = {k: (v[idx] if isinstance(v, np.ndarray) else [v[i] for i in idx]) for k, v in data.items()}
    message = b"".join(bytes(b) for b in encode({"t.x": (SNAP_COLUMNS, data)}, {"rank": 0}))
    return decode(message)


def run(sql, decoded):
    with Workspace() as ws:
        ws.load_snapshot(0, decoded)
        return ws.execute(rename_tables_sql(sql, ws.tables[0]), timeout=30).rows


def test_the_snapshot_form_keeps_types_and_nulls():
    rows = run(
        "SELECT step, loss, module, at, flag, n FROM t.x WHERE step IN (0, 1, 4) ORDER BY step",
        roundtrip(snapshot_data()),
    )
    assert rows[0][2] is None and rows[0][5] is None and rows[0][1] is None  # a masked (missing) float is NULL
    assert rows[1][:3] == [1, 0.5, "encoder.läyer"] and rows[1][5] == 10
    assert rows[2][2] == "head\n'x'" and rows[2][4] is False and rows[2][5] is None
    assert str(rows[0][3]).startswith("2023-11-14")


def test_nan_and_infinity_stay_values_and_missing_stays_null():
    # given: a float column with NaN (step 7, 14, ...), Inf (step 9) and missing values (step 0, 11, 22, 33)
    sql = (
        "SELECT step, isnan(loss) AS nan, isinf(loss) AS inf, loss IS NULL AS missing FROM t.x "
        "WHERE step IN (7, 9, 11, 12) ORDER BY step"
    )
    # then: through the wire, and registered in memory (a table generator's numpy and list outputs)
    assert run(sql, roundtrip(snapshot_data())) == [
        [7, True, False, False],
        [9, False, True, False],
        [11, None, None, True],
        [12, False, False, False],
    ]
    listed = dict(snapshot_data(), loss=[None if v is np.ma.masked else float(v) for v in snapshot_data()["loss"]])
    got = execute(sql, {"t.x": (SNAP_COLUMNS, listed)}).rows
    assert got == [[7, True, False, False], [9, False, True, False], [11, None, None, True], [12, False, False, False]]


WHERES = [
    "step > 10",
    "step >= 10 AND step < 20",
    "loss < 0.1",
    "loss > 0.1",
    "module = 'encoder.läyer'",
    "module <> 'encoder.läyer'",
    "module IN ('head\n''x''', 'nope')",
    "module IS NULL",
    "module IS NOT NULL",
    "n > 100",
    "n IS NULL",
    "flag",
    "flag = true",
    "step = 3 OR module IS NULL",
    "10 < step",
    "step = -1",
    "loss = 0.5 OR step > 35",
    "step > 5 AND lower(module) = 'head'",
    "isnan(loss)",
    "loss IS NULL",
    "loss > 1",
    "loss IS NULL OR loss < 0.05",
]


@pytest.mark.parametrize("where", WHERES)
def test_a_pushed_down_filter_never_changes_the_answer(where):
    sql = f"SELECT step, loss, module, n FROM t.x WHERE {where} ORDER BY step"
    cond = sqlglot.parse_one(f"SELECT 1 FROM t WHERE {where}", read="duckdb").args["where"].this
    tree = filter_tree(cond, dict(SNAP_COLUMNS))
    expected = run(sql, roundtrip(snapshot_data()))
    got = run(sql, roundtrip(snapshot_data(), tree))
    assert repr(got) == repr(expected)


def test_a_snapshot_over_its_byte_cap_is_refused_before_it_is_sent():
    with pytest.raises(OverflowError, match="t.x"):
        encode({"t.x": (SNAP_COLUMNS, snapshot_data())}, {}, max_bytes=100)


def test_a_ring_keeps_nan_apart_from_missing_through_wraparound_and_late_writes():
    from probe.util.ring import Ring

    # given: a ring of 8 rows that has wrapped; None is missing, NaN a value, some cells written late
    ring = Ring({"step": "i8", "loss": "f8"}, 8)
    for step in range(1, 13):
        ring.append(step, None if step % 3 == 0 else math.nan if step == 10 else float(step))
    ring.set("loss", 11, None)  # row 11 is step 12: unknown after all
    ring.set("loss", 8, 9.5)  # row 8 is step 9: read late
    ring.extend({"step": np.array([13, 14]), "loss": np.ma.masked_array([math.inf, 0.0], mask=[False, True])}, 2)
    snap = ring.snapshot()
    assert isinstance(snap["loss"], np.ma.MaskedArray) and not isinstance(snap["step"], np.ma.MaskedArray)
    # when
    data = {"step": snap["step"], "loss": snap["loss"]}
    message = b"".join(bytes(b) for b in encode({"t.r": ([("step", "BIGINT"), ("loss", "DOUBLE")], data)}, {}))
    rows = run("SELECT step, loss FROM t.r ORDER BY step", decode(message))
    # then
    assert [r[0] for r in rows] == list(range(7, 15))
    got = {s: ("nan" if v is not None and v != v else v) for s, v in rows}
    assert got == {7: 7.0, 8: 8.0, 9: 9.5, 10: "nan", 11: 11.0, 12: None, 13: math.inf, 14: None}
