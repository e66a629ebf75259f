"""The plan cache (sql/plan_cache.py) of the doctor and the query path: a plan comes back as it was made, only for
the same SQL, schema and view parameters; a cache file that is not a private file of this user is never read; the
in-memory store writes nothing."""

from __future__ import annotations

import pytest

import os

from probe.sql.federate import plan
from probe.sql.plan_cache import PlanCache, forget
from probe.sql.pushdown import snapshot_requests

SCHEMA = {"torch.steps": {"step": "BIGINT", "loss": "DOUBLE", "rank": "INTEGER"}}
SQL = "SELECT rank, max(step) AS step FROM torch.steps WHERE loss > 1 GROUP BY rank"


def test_a_plan_comes_back_for_the_same_sql_schema_and_parameters_only(tmp_path):
    # given: a plan made and saved
    made = plan(SQL, SCHEMA)
    first = PlanCache(SCHEMA, {"hung_after": 60.0}, str(tmp_path))
    assert first.get(SQL) is None
    first.put(SQL, made)
    first.save()
    # then: the next run reads it back as it was
    again = PlanCache(SCHEMA, {"hung_after": 60.0}, str(tmp_path)).get(SQL)
    assert again == made
    # and: another schema, other parameters or other SQL miss
    other = dict(SCHEMA, **{"torch.steps": dict(SCHEMA["torch.steps"], extra="VARCHAR")})
    assert PlanCache(other, {"hung_after": 60.0}, str(tmp_path)).get(SQL) is None
    assert PlanCache(SCHEMA, {"hung_after": 5.0}, str(tmp_path)).get(SQL) is None
    assert PlanCache(SCHEMA, {"hung_after": 60.0}, str(tmp_path)).get(SQL + " ") is None


def test_a_cache_file_others_may_write_is_never_read(tmp_path):
    cache = PlanCache(SCHEMA, {}, str(tmp_path))
    cache.put(SQL, plan(SQL, SCHEMA))
    cache.save()
    (path,) = [p for p in tmp_path.iterdir() if p.name == "doctor-plans.json"]
    os.chmod(path, 0o666)
    assert PlanCache(SCHEMA, {}, str(tmp_path)).get(SQL) is None
    # a file that is not JSON is an empty cache, not an error
    os.chmod(path, 0o600)
    path.write_text("{not json")
    assert PlanCache(SCHEMA, {}, str(tmp_path)).get(SQL) is None


def test_the_memory_store_keeps_plans_and_requests_for_this_process_only(tmp_path, monkeypatch):
    forget()
    # given: a query planned once in memory, with what every rank must snapshot for it
    first = PlanCache(SCHEMA, {}, str(tmp_path), store="memory")
    made = first.plan(SQL)
    asked = first.requests(made.parts)
    assert asked == snapshot_requests(made.parts, SCHEMA)
    first.save()
    # then: the next cache of this process has both, as they were (the requests without parsing again), and no
    # file was written
    import probe.sql.pushdown as pushdown

    monkeypatch.setattr(pushdown, "snapshot_requests", lambda *a: pytest.fail("the requests were made again"))
    again = PlanCache(SCHEMA, {}, str(tmp_path), store="memory")
    assert again.get(SQL) == made and again.requests(made.parts) == asked
    assert list(tmp_path.iterdir()) == []
    # and: forgotten, they are gone
    forget()
    assert PlanCache(SCHEMA, {}, str(tmp_path), store="memory").get(SQL) is None
