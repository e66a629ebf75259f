"""Rules' SQL on DuckDB over hand-made rows, for conditions no CPU job here reaches quickly."""

from __future__ import annotations


def _lr_zero(history: list) -> list:
    import duckdb

    from probe.cli._diagnose import _fill
    from probe.diagnosis import builtin  # noqa: F401
    from probe.diagnosis.rules import get_rule

    rule = get_rule("lr_zero")
    con = duckdb.connect()
    con.execute("CREATE SCHEMA torch")
    con.execute("CREATE TABLE torch.optimizer (rank INTEGER, optimizer VARCHAR, param_group INTEGER, params INTEGER, lr DOUBLE)")
    con.execute("INSERT INTO torch.optimizer VALUES (NULL, 'AdamW', 0, 29, 0.0)")
    con.execute("CREATE TABLE torch.steps (rank INTEGER, step BIGINT, lr DOUBLE)")
    con.executemany("INSERT INTO torch.steps VALUES (NULL, ?, ?)", history)
    cur = con.execute(rule.sql)
    return [_fill(rule.message, dict(zip([d[0] for d in cur.description], row))) for row in cur.fetchall()]


def test_lr_zero_says_when_a_schedule_ran_out_before_the_run_did():
    # a rate that was 0 from the start: the plain sentence
    assert _lr_zero([(1, 0.0), (2, 0.0)]) == ["AdamW param group 0 (29 tensors) has learning rate 0."]
    # a cosine schedule that reached 0 at step 5000 of a run that goes on: since when, and that nothing changes since
    hist = [(s, 3e-3 * (5000 - s) / 5000) for s in range(1, 5001)] + [(s, 0.0) for s in range(5001, 5201)]
    (said,) = _lr_zero(hist)
    assert said.startswith("AdamW param group 0 (29 tensors) has learning rate 0 since step 5000, where its schedule "
                           "reached 0 after 4999 steps at a positive rate"), said
    assert "its 201 steps since changed nothing" in said
