"""The REPL's completion engine alone, against a fixed schema (no process)."""

from __future__ import annotations

import pytest

from probe.cli.repl.completer import Schema, SqlCompleter, suggest, tables_in_scope
from probe.cli.repl.session import is_complete, split_statements

SCHEMA = Schema(
    {
        "python.backtrace": [("func", "VARCHAR"), ("file", "VARCHAR"), ("lineno", "BIGINT"), ("depth", "INTEGER")],
        "python.threads": [("name", "VARCHAR"), ("daemon", "BOOLEAN"), ("state", "VARCHAR")],
        "torch.steps": [("step", "BIGINT"), ("loss", "DOUBLE"), ("duration", "DOUBLE")],
    },
    functions=["floor", "first", "stddev", "sum"],
)
SPECIALS = {"\\dt": "List tables.", "\\d": "Describe a table.", "\\format": "Set the format."}


def texts(text, cursor=None):
    return [t for t, _, _ in suggest(text, cursor, SCHEMA, SPECIALS)]


def test_columns_of_the_from_table_after_where():
    got = texts("SELECT * FROM python.backtrace WHERE f")
    assert got[:2] == ["func", "file"]
    assert "name" not in got and "floor" in got


def test_columns_when_the_from_clause_follows_the_cursor():
    text = "SELECT st FROM torch.steps"
    got = texts(text, cursor=len("SELECT st"))
    assert "step" in got and "stddev" in got and "state" not in got


def test_columns_of_joined_tables_and_aliases():
    text = "SELECT * FROM python.backtrace b JOIN python.threads AS t ON t."
    assert texts(text) == ["name", "daemon", "state"]
    assert texts("SELECT b.li FROM python.backtrace b", len("SELECT b.li")) == ["lineno"]
    assert tables_in_scope("SELECT 1 FROM backtrace, python.threads t", SCHEMA) == {
        "backtrace": "python.backtrace",
        "python.backtrace": "python.backtrace",
        "threads": "python.threads",
        "python.threads": "python.threads",
        "t": "python.threads",
    }


def test_tables_and_schemas_after_from():
    got = texts("SELECT * FROM ")
    assert {"python.backtrace", "torch.steps", "python", "torch"} <= set(got)
    assert texts("SELECT * FROM python.") == ["backtrace", "threads"]
    assert texts("SELECT * FROM torch.steps JOIN py") == ["python.backtrace", "python.threads", "python"]


def test_replacement_length_is_the_part_after_the_dot():
    [(text, meta, n)] = suggest("SELECT b.dep FROM python.backtrace b", len("SELECT b.dep"), SCHEMA)
    assert (text, meta, n) == ("depth", "INTEGER", 3)


def test_keywords_at_the_start_and_nothing_inside_a_string():
    assert texts("sel") == ["SELECT"]
    assert texts("SELECT * FROM torch.steps WHERE loss > 'fl") == []
    assert "GROUP BY" in texts("SELECT step FROM torch.steps GRO")


def test_special_commands_and_their_arguments():
    assert texts("\\d") == ["\\dt"]
    assert texts("\\d python.t") == ["python.threads"]
    assert texts("\\format j") == ["json"]


def test_prompt_toolkit_adapter_yields_completions():
    from prompt_toolkit.document import Document

    doc = Document("SELECT * FROM torch.steps WHERE lo")
    [c] = [c for c in SqlCompleter(SCHEMA).get_completions(doc, None) if c.text == "loss"]
    assert c.start_position == -2


@pytest.mark.parametrize(
    "text,complete",
    [
        ("SELECT 1", False),
        ("SELECT 1;", True),
        ("SELECT 1\n  FROM t;  ", True),
        ("\\dt", True),
        ("", True),
        ("quit", True),
    ],
)
def test_enter_runs_only_a_finished_statement(text, complete):
    assert is_complete(text) is complete


def test_statements_split_at_semicolons_outside_strings():
    assert split_statements("SELECT 'a;b'; SELECT 2;") == ["SELECT 'a;b'", "SELECT 2"]
