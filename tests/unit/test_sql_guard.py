"""The SQL guard alone (no process): what it accepts, what it refuses, and its messages."""

import pytest

from probe import QueryError
from probe.sql.guard import guard

KNOWN = ["python.backtrace", "python.threads", "probe.tables", "probe.columns"]

REFUSED = {
    "drop": ("DROP TABLE python.threads", "only read queries"),
    "create": ("CREATE TABLE t AS SELECT 1", "only read queries"),
    "insert": ("INSERT INTO python.threads VALUES (1)", "only read queries"),
    "update": ("UPDATE python.threads SET name = 'x'", "only read queries"),
    "delete": ("DELETE FROM python.threads", "only read queries"),
    "copy": ("COPY python.threads TO '/tmp/x.csv'", "only read queries"),
    "attach": ("ATTACH '/tmp/x.db' AS x", "only read queries"),
    "install": ("INSTALL httpfs", "only read queries"),
    "load": ("LOAD httpfs", "only read queries"),
    "pragma": ("PRAGMA threads=4", "only read queries"),
    "set": ("SET threads = 4", "only read queries"),
    "read_csv": ("SELECT * FROM read_csv('/etc/passwd')", "not allowed"),
    "read_parquet": ("SELECT * FROM read_parquet('/tmp/x.parquet')", "not allowed"),
    "read_text": ("SELECT * FROM read_text('/etc/passwd')", "not allowed"),
    "glob": ("SELECT * FROM glob('/etc/*')", "not allowed"),
    "read_json_scalar": ("SELECT (SELECT COUNT(*) FROM read_json('/x.json'))", "not allowed"),
    "query_fn": ("SELECT * FROM query('SELECT 1')", "not allowed"),
    "file_as_table": ("SELECT * FROM '/etc/passwd'", "unknown table"),
    "multi": ("SELECT 1; SELECT 2", "one statement"),
    "unknown": ("SELECT * FROM nope.nothing", "unknown table"),
    "catalog": ("SELECT * FROM memory.python.threads", "catalog"),
    # a CTE named like a DuckDB catalog view is visible only inside its own subquery
    "cte_out_of_scope": (
        "SELECT * FROM (WITH pg_settings AS (SELECT 1 a) SELECT a FROM pg_settings) s, pg_settings",
        "unknown table pg_settings",
    ),
    "cte_in_union_branch": (
        "(WITH duckdb_settings AS (SELECT 1 a) SELECT a FROM duckdb_settings) UNION ALL SELECT 1 FROM duckdb_settings",
        "unknown table duckdb_settings",
    ),
    # functions run on an allow-list: settings, environment, catalog and SQL strings are not on it
    "getenv": ("SELECT getenv('HOME')", "getenv() is not allowed"),
    "current_setting": ("SELECT current_setting('temp_directory')", "current_setting() is not allowed"),
    "catalog_fn": ("SELECT * FROM duckdb_settings()", "not allowed"),
    "sql_string": ("SELECT json_execute_serialized_sql('{}')", "not allowed"),
    "nested_fn": ("SELECT upper(getenv('HOME')) FROM python.threads", "getenv() is not allowed"),
    "deep": ("SELECT " + "(" * 5000 + "1" + ")" * 5000, "nests too deeply"),
    "huge": ("SELECT '" + "x" * 200_000 + "'", "the limit is"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name):
    sql, fragment = REFUSED[name]
    with pytest.raises(QueryError) as err:
        guard(sql, KNOWN)
    assert fragment in err.value.message
    assert err.value.message.endswith(".")


def test_unknown_table_lists_the_known_ones():
    with pytest.raises(QueryError) as err:
        guard("SELECT * FROM python.nothing", KNOWN)
    for name in KNOWN:
        assert name in err.value.message


def test_syntax_error_keeps_line_and_column():
    with pytest.raises(QueryError) as err:
        guard("SELECT func\nFROM python.backtrace\nWHERE (", KNOWN)
    assert err.value.line == 3
    assert err.value.col is not None
    assert "line 3" in err.value.message


def test_accepts_ctes_unions_and_table_functions():
    g = guard(
        "WITH t AS (SELECT name FROM python.threads) SELECT * FROM t UNION ALL SELECT 'x' "
        "UNION ALL SELECT CAST(range AS VARCHAR) FROM range(3)",
        KNOWN,
    )
    assert g.tables == ("python.threads",)


def test_unqualified_unique_name_resolves():
    g = guard("SELECT func FROM backtrace", KNOWN)
    assert g.tables == ("python.backtrace",)
    assert "python.backtrace" in g.sql


def test_describe_and_show_become_registry_queries():
    assert guard("DESCRIBE python.threads", KNOWN).tables == ("probe.columns",)
    assert guard("SHOW TABLES", KNOWN).tables == ("probe.tables",)


def test_a_cte_still_shadows_a_table_inside_its_scope():
    g = guard("WITH threads AS (SELECT 1 AS name) SELECT name FROM threads", KNOWN)
    assert g.tables == ()


@pytest.mark.parametrize(
    "expr",
    [
        "coalesce(NULL, 1)",
        "count(*)",
        "median(1)",
        "row_number() OVER ()",
        "lag(1) OVER ()",
        "regexp_replace('a', 'a', 'b')",
        "epoch(current_timestamp)",
        "strftime(now(), '%Y')",
        "list_sum([1, 2])",
        "CASE WHEN true THEN 1 END",
        "CAST(1 AS VARCHAR)",
        "extract(year FROM current_date)",
        "quantile_cont(1, 0.5)",
        "string_agg('a', ',')",
    ],
)
def test_common_functions_are_on_the_allow_list(expr):
    assert guard(f"SELECT {expr}", KNOWN).sql


def _every_function_name() -> list[str]:
    """Every function name sqlglot knows: its expression classes' SQL names and every dialect's parser map."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.dialects.dialect import Dialect

    names = set()
    for cls in vars(exp).values():
        if isinstance(cls, type) and issubclass(cls, exp.Func):
            try:
                names.update(cls.sql_names())
            except NotImplementedError:  # an abstract class of functions, not one that SQL can name
                pass
    names.update(sqlglot.parser.Parser.FUNCTIONS)
    for dialect in set(Dialect.classes.values()):
        names.update(dialect.parser_class.FUNCTIONS)
    return sorted({n.lower() for n in names if n.replace("_", "").isalnum()})


def test_every_function_sqlglot_knows_is_answered_or_refused_in_one_sentence():
    from probe.cli.query_runner import run_outer
    from probe.sql.engine import Workspace
    from probe.sql.federate import plan

    # given the CLI's path: plan (guard, rewrite), then the outer query on a DuckDB workspace (the calls read no
    # table: splitting a query over a table costs milliseconds each, and the call is the subject here)
    schema = {"python.threads": {"name": "VARCHAR", "thread_id": "BIGINT"}}
    ws = Workspace(timeout=60)
    try:
        names = _every_function_name()
        assert len(names) > 500 and {"date", "datetime", "var_map", "time"} <= set(names)
        answered = 0
        # when every function is called with no, one and two string arguments
        for name in names:
            for args in ("", "'a'", "'a', 'b'"):
                sql = f"SELECT {name}({args})"
                try:
                    p = plan(sql, schema)
                    run_outer(ws, p.outer, 10, timeout=10)
                    answered += 1
                except QueryError as err:
                    # then a refusal is a QueryError (exit 2) with one sentence, nothing else
                    assert err.exit_code == 2 and err.message and "\n" not in err.message, (sql, err)
        assert answered > 50  # the allowed functions still run
    finally:
        ws.close()
    # and the calls that broke sqlglot's own builders say which function to check
    with pytest.raises(QueryError, match=r"^date\(\) with these arguments could not be read"):
        guard("SELECT date()", KNOWN)
