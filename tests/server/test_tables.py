"""Every example query of every registered table runs against a real training process,
and every table and column is described (tests/cli/test_docs.py checks the generated reference)."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager

import pytest

from conftest import EXAMPLES, ROOT, requires_torch
from harness import clean_env, run_probe, start, stop_groups
from probe.tables.registry import all_tables

EXAMPLES_SQL = [(t.name, sql) for t in all_tables() for sql in t.examples]


@contextmanager
def _train_gpt(*extra):
    """examples/train_gpt.py with ``extra`` arguments, past its first steps; yields (pid, env), stops it after."""
    env = clean_env()
    job = start([EXAMPLES / "train_gpt.py", "--print-every", "10", *extra], env, ready=None)
    try:
        job.wait_match(r"^step 20 ", timeout=120)
        yield job.pid, env
    finally:
        stop_groups([job.popen], grace=10)
        shutil.rmtree(env["PROBE_RUNTIME_DIR"], ignore_errors=True)


@pytest.fixture(scope="module")
def training():
    """examples/train_gpt.py running (until the module's tests end), past its first steps. The tests that use it
    only read it: --step-sleep keeps it stepping (a boundary every ~0.1 s) without taking a core, for the whole
    module, from the `probe` calls the tests wait on."""
    with _train_gpt("--step-sleep", "0.1") as job:
        yield job


@pytest.fixture
def training_flat_out():
    """examples/train_gpt.py stepping as fast as it can: most of its time in forward and backward, where a read
    of the gradients that did not wait for a step boundary would land."""
    with _train_gpt() as job:
        yield job


@requires_torch
@pytest.mark.parametrize("table, sql", EXAMPLES_SQL, ids=[f"{t}:{i}" for i, (t, _) in enumerate(EXAMPLES_SQL)])
def test_every_table_example_runs(training, table, sql):
    pid, env = training
    r = run_probe(pid, "query", sql, "-f", "json", env=env, timeout=60)
    assert r.returncode == 0, f"{table}: {sql}\n{r.stderr}"
    assert isinstance(json.loads(r.stdout), list)


def test_every_table_has_examples_and_documented_columns():
    for t in all_tables():
        assert t.examples, f"{t.name} has no example query"
        assert t.description.endswith(".")
        for c in t.columns:
            assert c.description.endswith("."), (t.name, c.name)


def _readme_playbook_queries():
    import re

    text = (ROOT / "README.md").read_text()
    section = text.split("## Playbook", 1)[1].split("\n## ", 1)[0]
    return [q for q in re.findall(r"`(SELECT [^`]+)`", section) if "ranks." not in q]


@requires_torch
@pytest.mark.parametrize("sql", _readme_playbook_queries())
def test_readme_playbook_queries_run(training, sql):
    pid, env = training
    r = run_probe(pid, "query", sql, "-f", "json", env=env, timeout=60)
    assert r.returncode == 0, f"{sql}\n{r.stderr}"


@requires_torch
def test_parameter_queries_during_training_read_at_the_step_boundary(training_flat_out):
    # given: a job stepping flat out, and several clients reading parameters and gradients at once
    # (autograd writes .grad from its own threads: reading it from the server thread mid-backward
    # crashed the process now and then, so the table reads at the step boundary)
    pid, env = training_flat_out
    sql = "SELECT count(*) AS n, count(grad_norm) AS with_grad, sum(nan_count) AS nans FROM torch.parameters"

    def burst(_):  # one client running 8 queries in a row (the REPL reading a script: one `probe` start-up, not 8)
        r = run_probe("--format", "json", pid, env=env, timeout=120, input=f"{sql};\n" * 8)
        assert r.returncode == 0, r.stderr
        decoder, text, at, out = json.JSONDecoder(), r.stdout.strip(), 0, []
        while at < len(text):
            (row,), at = decoder.raw_decode(text, at)
            out.append(row)
            at = len(text) - len(text[at:].lstrip())
        assert len(out) == 8, r.stdout
        return out

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        rows = [row for rs in pool.map(burst, range(3)) for row in rs]
    # then: the job is alive and every answer has the statistics (read at a boundary, not skipped)
    os.kill(pid, 0)
    assert all(row["n"] > 0 and row["nans"] == 0 and row["with_grad"] == row["n"] for row in rows), rows
