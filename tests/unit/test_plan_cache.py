"""The doctor's plan cache (sql/plan_cache.py): a plan comes back as it was made, only for the same SQL, schema
and view parameters, and a cache file that is not a private file of this user is never read."""

from __future__ import annotations

import os

from probe.sql.federate import plan
from probe.sql.plan_cache import PlanCache

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
