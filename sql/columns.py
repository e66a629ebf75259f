"""Snapshots as DuckDB relations: declared column types checked against a small allow-list (a type is a word,
never more SQL), typed SELECTs over the raw arrays, and several ranks' snapshots combined into one table each
with the rank's slot (``concat_snapshots``), for the engine (``engine``).
"""

from __future__ import annotations

import re

from probe.util.wire import column_arrays


SLOT = "__slot"  # the column saying which rank's snapshot a row of a combined table came from

_SIMPLE_TYPES = (
    "BIGINT",
    "INTEGER",
    "DOUBLE",
    "VARCHAR",
    "BOOLEAN",
    "TIMESTAMP",
    "FLOAT",
    "SMALLINT",
    "TINYINT",
    "HUGEINT",
    "UBIGINT",
    "UINTEGER",
    "DATE",
    "DECIMAL",
    "TIMESTAMP WITH TIME ZONE",
)
_SIMPLE_TYPE = re.compile(r"^[A-Z ]+(\(\d{1,2}(, ?\d{1,2})?\))?$")  # DECIMAL(18,3): a type word, never more SQL
_FLOAT_TYPES = ("DOUBLE", "FLOAT", "REAL")


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def typed_select(columns, source: str) -> str:
    """SELECT casting the raw columns of ``source`` to their declared types.

    ``columns`` is ``[(name, type, kind, has_nulls)]``; a numeric column with NULLs reads its
    ``__valid__<name>`` companion. TIMESTAMP columns arrive as epoch seconds.

    DuckDB's numpy scan reads NaN as NULL; a float array here has no NULLs of its own (those
    are in the companion), so a NULL read from a DOUBLE column is a NaN and is put back.

    >>> typed_select([("t", "TIMESTAMP", "f8", False), ("s", "VARCHAR", "str", True)], "raw")
    'SELECT make_timestamp(CAST(round("t" * 1000000) AS BIGINT)) AS "t", CAST("s" AS VARCHAR) AS "s" FROM "raw"'
    >>> print(typed_select([("x", "DOUBLE", "f8", True)], "raw"))
    SELECT CASE WHEN "__valid__x" THEN coalesce(CAST("x" AS DOUBLE), CAST('NaN' AS DOUBLE)) END AS "x" FROM "raw"
    """
    exprs = []
    for name, typ, kind, has_nulls in columns:
        q = quote(name)
        if kind == "str" and typ not in ("VARCHAR",):
            expr = f"TRY_CAST({q} AS {typ})"
        elif typ == "TIMESTAMP":
            expr = f"make_timestamp(CAST(round({q} * 1000000) AS BIGINT))"
        elif kind == "f8" and typ in _FLOAT_TYPES:
            expr = f"coalesce(CAST({q} AS {typ}), CAST('NaN' AS {typ}))"
        else:
            expr = f"CAST({q} AS {typ})"
        if has_nulls and kind != "str":
            expr = f"CASE WHEN {quote('__valid__' + name)} THEN {expr} END"
        exprs.append(f"{expr} AS {q}")
    return f"SELECT {', '.join(exprs) or '1 AS _empty'} FROM {quote(source)}"


def raw_columns(columns: list, data: dict) -> tuple[dict, list]:
    """From ``[(name, type)]`` and ``{name: values}`` (a table generator's output): numpy arrays and typed_select's
    spec."""
    import numpy as np

    arrays, spec = {}, []
    for name, typ in columns:
        values = data[name]
        kind, valid = None, None
        if typ != "VARCHAR" or isinstance(values, np.ndarray) and values.dtype.kind in "fiub":
            kind, data_, valid = column_arrays(values, typ)  # as on the wire: None or masked is NULL, NaN a value
        if kind is not None and kind != "str":
            has_nulls = valid is not None and not valid.all()
            arrays[name] = data_
            if has_nulls:
                arrays["__valid__" + name] = valid
            spec.append((name, typ, kind, has_nulls))
            continue
        arr = np.empty(len(values), dtype=object)
        arr[:] = list(values)
        arrays[name] = arr
        spec.append((name, typ, "obj", False))
    return arrays, spec


def _concat_column(cols: list) -> dict:
    """One decoded column (``{"type", "kind", "data", "valid"}``) from the same column of several snapshots."""
    import numpy as np

    kinds = {c["kind"] for c in cols}
    texts = kinds & {"str", "dict"}
    if texts and kinds - texts:  # numbers on some ranks, text on others: all as text (typed_select casts it back)
        datas = []
        for c in cols:
            if c["kind"] in ("str", "dict"):
                datas.append(c["data"])
                continue
            out = np.empty(len(c["data"]), dtype=object)
            out[:] = [str(x) for x in c["data"].tolist()]
            if c["valid"] is not None:
                out[~c["valid"]] = None
            datas.append(out)
        return {"type": cols[0]["type"], "kind": "str", "data": np.concatenate(datas), "valid": None}
    if texts:
        return {
            "type": cols[0]["type"],
            "kind": "str" if "str" in kinds else "dict",
            "data": np.concatenate([c["data"] for c in cols]),
            "valid": None,
        }
    kind = "f8" if "f8" in kinds else "i8" if "i8" in kinds else "b1"
    dtype = {"f8": "<f8", "i8": "<i8", "b1": "|b1"}[kind]
    data = np.concatenate([np.asarray(c["data"], dtype=dtype) for c in cols])
    valid = None
    if any(c["valid"] is not None for c in cols):
        valid = np.concatenate([c["valid"] if c["valid"] is not None else np.ones(len(c["data"]), bool) for c in cols])
    return {"type": cols[0]["type"], "kind": kind, "data": data, "valid": valid}


def concat_snapshots(decoded: list) -> dict:
    """Several ranks' decoded snapshots (``probe.util.wire.decode``) as one, each table with a ``__slot`` column.

    Row ``k`` of a combined table came from ``decoded[slot[k]]``; a table or column that some
    snapshots lack is taken from those that have it. One registration per table then serves
    every rank (``Workspace.load_snapshot``), however many ranks answered.

    >>> import numpy as np
    >>> one = lambda v: {"tables": {"t.x": {"rows": len(v), "columns": {"a": {"type": "BIGINT", "kind": "i8",
    ...                  "data": np.array(v), "valid": None}}}}}
    >>> t = concat_snapshots([one([1, 2]), one([3])])["tables"]["t.x"]
    >>> t["rows"], t["columns"]["a"]["data"].tolist(), t["columns"]["__slot"]["data"].tolist()
    (3, [1, 2, 3], [0, 0, 1])
    """
    import numpy as np

    names: dict = {}
    for d in decoded:
        for name, t in d["tables"].items():
            names.setdefault(name, {}).update({c: v["type"] for c, v in t["columns"].items()})
    out = {}
    for name, columns in names.items():
        present = [(i, d["tables"][name]) for i, d in enumerate(decoded) if name in d["tables"]]
        cols = {}
        for col, typ in columns.items():
            parts = []
            for _, t in present:
                c = t["columns"].get(col)
                if c is None:  # an older rank without this column: NULLs
                    c = {
                        "type": typ,
                        "kind": "f8",
                        "data": np.full(t["rows"], np.nan),
                        "valid": np.zeros(t["rows"], bool),
                    }
                parts.append(c)
            cols[col] = _concat_column(parts)
        slot = (
            np.concatenate([np.full(t["rows"], i, dtype="<i8") for i, t in present]) if present else np.zeros(0, "<i8")
        )
        cols[SLOT] = {"type": "BIGINT", "kind": "i8", "data": slot, "valid": None}
        out[name] = {"rows": len(slot), "columns": cols}
    return {"meta": {}, "tables": out}


def is_simple_type(typ) -> bool:
    """Whether ``typ`` is one of the plain SQL types a result may be cast back to (a word, never more SQL)."""
    return _SIMPLE_TYPE.match(str(typ)) is not None and str(typ).split("(")[0] in _SIMPLE_TYPES
