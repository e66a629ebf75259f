"""SQL completion for the REPL from the live schema.

``Schema`` holds what the server's ``GET /tables`` reported plus DuckDB's function
names; ``suggest`` reads the statement under the cursor with sqlglot's tokenizer
(tolerant: an unfinished statement tokenizes fine) and decides what fits there:
tables after FROM/JOIN, the columns of the tables in the FROM clause after SELECT,
WHERE, ON, GROUP BY..., ``x.`` completes the tables of schema ``x`` or the columns
of table/alias ``x``, and a leading backslash completes special commands.
``SqlCompleter`` adapts it to prompt-toolkit; the REPL swaps in a new one through a
``DynamicCompleter`` whenever the schema is refreshed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prompt_toolkit.completion import Completer, Completion


# Clause keywords after which column names make sense.
_COLUMN_CLAUSES = {
    "SELECT",
    "WHERE",
    "ON",
    "GROUP_BY",
    "ORDER_BY",
    "HAVING",
    "QUALIFY",
    "USING",
    "DISTINCT",
    "BY",
    "AND",
    "OR",
    "NOT",
    "CASE",
    "WHEN",
    "THEN",
    "ELSE",
    "BETWEEN",
    "IN",
    "IS",
    "LIKE",
    "ILIKE",
}
_TABLE_CLAUSES = {"FROM", "JOIN", "DESCRIBE"}
# Clauses whose words are columns and functions of the tables in scope.
_COLUMN_STARTS = ("SELECT", "WHERE", "ON", "GROUP_BY", "ORDER_BY", "HAVING", "QUALIFY")
# Tokens that end a table reference in FROM (a following word is then not an alias).
_FROM_ENDERS = {
    "WHERE",
    "GROUP_BY",
    "ORDER_BY",
    "HAVING",
    "LIMIT",
    "ON",
    "USING",
    "JOIN",
    "LEFT",
    "RIGHT",
    "INNER",
    "OUTER",
    "FULL",
    "CROSS",
    "NATURAL",
    "POSITIONAL",
    "ASOF",
    "SEMI",
    "ANTI",
    "UNION",
    "EXCEPT",
    "INTERSECT",
    "WINDOW",
    "QUALIFY",
    "SEMICOLON",
    "R_PAREN",
    "COMMA",
    "OFFSET",
    "FETCH",
}
_WRITE_WORDS = {
    "INSERT",
    "UPDATE",
    "DELETE",
    "DROP",
    "CREATE",
    "ALTER",
    "TRUNCATE",
    "COPY",
    "ATTACH",
    "DETACH",
    "INSTALL",
    "LOAD",
    "PRAGMA",
    "SET",
    "COMMIT",
    "BEGIN",
    "ROLLBACK",
    "GRANT",
    "REVOKE",
    "MERGE",
    "REPLACE",
    "VACUUM",
    "EXPORT",
    "IMPORT",
    "CACHE",
    "UNCACHE",
    "USE",
    "EXECUTE",
}


@dataclass
class Schema:
    """Tables (``schema.table`` -> ``[(column, type)]``) and function names known to the completer."""

    tables: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    functions: list[str] = field(default_factory=list)
    descriptions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_tables_doc(cls, doc: dict, functions: list[str] | None = None) -> "Schema":
        tables = {t["name"]: [(c["name"], c["type"]) for c in t["columns"]] for t in doc.get("tables", [])}
        return cls(tables, list(functions or []), {t["name"]: t.get("description", "") for t in doc.get("tables", [])})

    @property
    def schemas(self) -> list[str]:
        return sorted({name.split(".", 1)[0] for name in self.tables})

    def resolve(self, name: str) -> str | None:
        """``schema.table`` for a full or unambiguous short table name, else None."""
        name = name.lower()
        if name in self.tables:
            return name
        hits = [full for full in self.tables if full.split(".", 1)[1] == name]
        return hits[0] if len(hits) == 1 else None


_keywords_cache: list[str] | None = None


def sql_keywords() -> list[str]:
    """Read-only SQL keywords from sqlglot's tokenizer (write statements are left out: the guard refuses them)."""
    global _keywords_cache
    if _keywords_cache is None:
        from sqlglot.tokens import Tokenizer

        words = {k for k in Tokenizer.KEYWORDS if k.replace(" ", "").replace("_", "").isalpha()}
        _keywords_cache = sorted(w for w in words if w.split(" ")[0] not in _WRITE_WORDS)
    return _keywords_cache


def duckdb_function_names() -> list[str]:
    """Names of DuckDB's built-in functions, read from a local in-memory DuckDB."""
    import duckdb

    con = duckdb.connect(":memory:")
    try:
        rows = con.execute(
            "SELECT DISTINCT function_name FROM duckdb_functions() "
            "WHERE function_type IN ('scalar', 'aggregate', 'macro', 'table', 'table_macro')"
        ).fetchall()
    finally:
        con.close()
    return sorted({r[0] for r in rows if r[0] and r[0][0].isalpha() and not r[0].startswith("__")})


def _tokens(text: str):
    from sqlglot.errors import TokenError
    from sqlglot.tokens import Tokenizer

    try:
        return Tokenizer().tokenize(text)
    except TokenError:
        return None


def _word_before(text: str) -> str:
    """The identifier (with dots) that ends at the cursor."""
    i = len(text)
    while i > 0 and (text[i - 1].isalnum() or text[i - 1] in "_."):
        i -= 1
    return text[i:]


def _statement_bounds(text: str, cursor: int) -> tuple[int, int]:
    """Start and end offsets of the statement around ``cursor`` (statements end with ';')."""
    start = text.rfind(";", 0, cursor) + 1
    end = text.find(";", cursor)
    return start, (len(text) if end < 0 else end)


def tables_in_scope(statement: str, schema: Schema) -> dict[str, str]:
    """``{alias or name: schema.table}`` for the tables the FROM/JOIN clauses of ``statement`` name."""
    tokens = _tokens(statement) or []
    scope: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        if tokens[i].token_type.name not in ("FROM", "JOIN", "COMMA") or (
            tokens[i].token_type.name == "COMMA" and not _in_from(tokens, i)
        ):
            i += 1
            continue
        j = i + 1
        parts = []
        while (
            j < len(tokens)
            and tokens[j].token_type.name not in _FROM_ENDERS
            and tokens[j].token_type.name not in ("L_PAREN", "ALIAS")
        ):
            if tokens[j].token_type.name == "DOT":
                j += 1
                continue
            if parts and tokens[j - 1].token_type.name != "DOT":
                break
            parts.append(tokens[j].text.strip('"'))
            j += 1
        full = schema.resolve(".".join(parts)) if parts else None
        if full is None:
            i = j
            continue
        scope[parts[-1].lower()] = full
        scope[full] = full
        if j < len(tokens) and tokens[j].token_type.name == "ALIAS":
            j += 1
        if j < len(tokens) and tokens[j].token_type.name not in _FROM_ENDERS and tokens[j].token_type.name != "L_PAREN":
            scope[tokens[j].text.strip('"').lower()] = full
            j += 1
        i = j
    return scope


def _in_from(tokens, i: int) -> bool:
    """Whether token ``i`` sits in a FROM clause (the nearest clause keyword before it is FROM or JOIN)."""
    depth = 0
    for t in reversed(tokens[:i]):
        name = t.token_type.name
        if name == "R_PAREN":
            depth += 1
        elif name == "L_PAREN":
            if depth == 0:
                return False
            depth -= 1
        elif depth == 0 and name in ("FROM", "JOIN"):
            return True
        elif depth == 0 and (name in _COLUMN_CLAUSES or name in ("WHERE", "LIMIT")):
            return False
    return False


def _clause(tokens) -> tuple[str | None, str | None]:
    """(nearest clause keyword at this paren depth, the last token's type) for the tokens before the word."""
    last = tokens[-1].token_type.name if tokens else None
    depth = 0
    for t in reversed(tokens):
        name = t.token_type.name
        if name == "R_PAREN":
            depth += 1
        elif name == "L_PAREN":
            if depth == 0:
                continue  # inside a call or sub-query: keep looking outward
            depth -= 1
        elif depth == 0 and (name in _TABLE_CLAUSES or name in _COLUMN_STARTS or name == "LIMIT"):
            return name, last
    return None, last


def _match(options, prefix: str, meta: str) -> list[tuple[str, str, int]]:
    p = prefix.lower()
    return [(o, meta, len(prefix)) for o in options if o.lower().startswith(p) and o.lower() != p]


def suggest(
    text: str, cursor: int | None = None, schema: Schema | None = None, specials: dict[str, str] | None = None
) -> list[tuple[str, str, int]]:
    """Completions ``[(text, meta, n)]`` for the word ending at ``cursor``; each replaces the ``n`` characters
    before it."""
    schema = schema or Schema()
    cursor = len(text) if cursor is None else cursor
    before = text[:cursor]
    word = _word_before(before)
    stripped = before.lstrip()
    if stripped.startswith("\\"):
        return _suggest_special(stripped, schema, specials or {})
    start, end = _statement_bounds(text, cursor)
    head = before[start : cursor - len(word)]
    tokens = _tokens(head)
    if tokens is None:
        return []  # inside a string literal
    if "." in word:
        qualifier, _, prefix = word.rpartition(".")
        q = qualifier.lower()
        if q in schema.schemas:
            names = [full.split(".", 1)[1] for full in schema.tables if full.startswith(q + ".")]
            return _match(sorted(names), prefix, "table")
        scope = tables_in_scope(text[start:end], schema)
        full = scope.get(q) or schema.resolve(q)
        if full:
            types = dict(schema.tables[full])
            return [(c, types[c], n) for c, _, n in _match(list(types), prefix, "")]
        return []
    clause, last = _clause(tokens)
    if clause in _TABLE_CLAUSES and last in ("FROM", "JOIN", "COMMA", "DESCRIBE"):
        return (
            _match(sorted(schema.tables), word, "table")
            + _match(sorted({f.split(".", 1)[1] for f in schema.tables}), word, "table")
            + _match(schema.schemas, word, "schema")
        )
    if clause is None and not tokens:
        return _match(["SELECT", "WITH", "DESCRIBE", "SHOW TABLES", "SUMMARIZE"], word, "keyword")
    out: list[tuple[str, str, int]] = []
    if clause in _COLUMN_STARTS:
        scope = tables_in_scope(text[start:end], schema)
        seen = set()
        for full in dict.fromkeys(scope.values()):
            for col, typ in schema.tables[full]:
                if col not in seen:
                    seen.add(col)
                    out.extend((c, f"{typ} · {full}", n) for c, _, n in _match([col], word, ""))
        out.extend(_match(schema.functions, word, "function"))
    if word:
        out.extend(_match(sql_keywords(), word, "keyword"))
    return out


def _suggest_special(line: str, schema: Schema, specials: dict[str, str]) -> list[tuple[str, str, int]]:
    name, sep, arg = line.partition(" ")
    if not sep:
        return [(n, h, len(name)) for n, h in sorted(specials.items()) if n.startswith(name) and n != name]
    word = _word_before(line)
    if name == "\\d":
        return _match(sorted(schema.tables), word, "table")
    if name == "\\format":
        return _match(["table", "json", "csv"], word, "format")
    if name == "\\watch" and " " in arg.strip():
        return suggest(arg.strip().partition(" ")[2], schema=schema)
    return []


class SqlCompleter(Completer):
    """prompt-toolkit completer over a fixed ``Schema`` (the REPL swaps in a new one on refresh)."""

    def __init__(self, schema: Schema, specials: dict[str, str] | None = None):
        self.schema = schema
        self.specials = specials or {}

    def get_completions(self, document, complete_event):
        for value, meta, n in suggest(document.text, document.cursor_position, self.schema, self.specials):
            yield Completion(value, start_position=-n, display_meta=meta)
