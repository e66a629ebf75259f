"""The binary columnar form in which a training process hands table snapshots to a client.

One message is::

    b"PRBC" | header length (u32, little endian) | header (JSON) | buffers

The header names every table, its row count and its columns; each column says its
declared SQL type, its physical ``kind`` and where its buffers lie in the message
(offset from the start of the buffers, length in bytes):

* ``f8`` / ``i8`` / ``b1``: one little-endian array (float64, int64, bool);
* ``str``: int64 end offsets (one per row) and the UTF-8 bytes of every value;
* ``dict``: int32 codes (one per row), then the distinct values as a ``str`` column
  (end offsets, bytes, valid): text columns of ring buffers repeat a few module and
  stage names, so a 100k-row column costs one dictionary pass, not 100k encodes;
* ``valid`` (optional, any kind): one byte per row, 0 where the value is NULL.

NULL and NaN are different things: a missing value is ``None`` (or a masked entry of a
``numpy.ma`` array) and travels as a 0 in ``valid``; a NaN or an infinity in a float column
is a value and travels as itself (the client keeps it NaN, see ``probe.sql.engine``).

Encoding works on numpy arrays, never on Python rows: a ring buffer's columns go out
as one copy each. Only object columns (values a table generator built in Python) are
walked value by value. The module needs numpy and nothing else, so the training side
(encode) and the client (decode) share it without pulling the query engine in.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass


MAGIC = b"PRBC"
_FIXED = {"f8": "<f8", "i8": "<i8", "b1": "|b1"}
_KINDS = ("f8", "i8", "b1", "str", "dict")
# The SQL types a table may declare: the one allow-list for the registry (probe.tables.registry) and for
# whatever arrives from elsewhere (a snapshot, a post-mortem record), since these words are written into SQL.
TYPES = ("BIGINT", "INTEGER", "DOUBLE", "VARCHAR", "BOOLEAN", "TIMESTAMP")
_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,63}\.[a-z_][a-z0-9_]{0,63}$")
_COLUMN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


@dataclass(frozen=True)
class Column:
    """A typed, described column of a table: a type of ``TYPES`` (a TIMESTAMP is produced as epoch seconds, a
    float) and a description that is a sentence. Here, below the registry, so that the training side can declare the
    columns its rings hold."""

    name: str
    type: str
    description: str

    def __post_init__(self):
        if self.type not in TYPES:
            raise ValueError(f"column {self.name}: type must be one of {', '.join(TYPES)}, not {self.type!r}")
        if not self.description.endswith("."):
            raise ValueError(f"column {self.name}: its description must be a sentence ending in a period")


class WireError(ValueError):
    """The message is not a probe snapshot (or is cut short, or declares a name or type outside the allow-list)."""


def check_table(name, columns) -> None:
    """Refuse (WireError) a table or column name, or a column type, that is not on the allow-list.

    A snapshot or a post-mortem record comes from a process, or a file, that may not be ours:
    its names and types reach the client's SQL, so they are checked before any of it is built.

    >>> check_table("torch.steps", [("step", "BIGINT")])
    >>> check_table("torch.steps", [("step", "BIGINT) AS x FROM range(1e14) --")])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    probe.util.wire.WireError: column step of torch.steps declares type 'BIGINT) AS x FROM range(1e14) --', which is
    not one of BIGINT, INTEGER, DOUBLE, VARCHAR, BOOLEAN, TIMESTAMP
    """
    if not isinstance(name, str) or not _TABLE.match(name):
        raise WireError(f"table name {str(name)[:80]!r} is not schema.table in lower-case letters, digits and _")
    for col, typ in columns:
        if not isinstance(col, str) or not _COLUMN.match(col):
            raise WireError(f"column name {str(col)[:80]!r} of {name} is not letters, digits and _")
        if typ not in TYPES:
            raise WireError(
                f"column {col} of {name} declares type {str(typ)[:80]!r}, which is not one of {', '.join(TYPES)}"
            )


def object_column(values, typ: str):
    """(kind, data, valid) for a column of Python values, by its declared type."""
    import numpy as np

    n = len(values)
    valid = np.fromiter((v is not None for v in values), bool, n)
    if typ in ("BIGINT", "INTEGER", "BOOLEAN"):
        try:
            data = np.fromiter((0 if v is None else v for v in values), "<i8", n)
            if np.array_equal(np.fromiter((0 if v is None else v for v in values), "<f8", n), data, equal_nan=False):
                return ("b1" if typ == "BOOLEAN" else "i8"), (data != 0 if typ == "BOOLEAN" else data), valid
        except (TypeError, ValueError, OverflowError):
            pass
    if typ in ("BIGINT", "INTEGER", "DOUBLE", "TIMESTAMP"):
        try:
            conv = (lambda v: v.timestamp()) if typ == "TIMESTAMP" else float
            data = np.fromiter(
                (math.nan if v is None else (conv(v) if hasattr(v, "timestamp") else float(v)) for v in values),
                "<f8",
                n,
            )
            return "f8", data, valid
        except (TypeError, ValueError, OverflowError, AttributeError):
            pass
    return "str", [v if isinstance(v, str) else ("" if v is None else str(v)) for v in values], valid


def _strings(data: list) -> list:
    import numpy as np

    encoded = [s.encode("utf-8", "surrogatepass") for s in data]
    ends = np.cumsum(np.fromiter(map(len, encoded), "<i8", len(encoded)), dtype="<i8")
    return [ends, b"".join(encoded)]


def _dictionary(seq: list):
    """(codes, distinct values) of a text column, or None when its values cannot be hashed.

    ``map(d.setdefault, values, count())`` runs in C: one dict lookup per row, no Python
    frame; codes are then made dense with one numpy gather.
    """
    import itertools

    import numpy as np

    n = len(seq)
    index: dict = {}
    try:
        sparse = np.fromiter(map(index.setdefault, seq, itertools.count()), "<i8", n)
    except TypeError:  # an unhashable value (a list): the plain path
        return None
    keys = list(index)
    dense = np.zeros(n, dtype="<i4")
    if n:
        lookup = np.empty(n, dtype="<i4")
        lookup[np.fromiter(index.values(), "<i8", len(keys))] = np.arange(len(keys), dtype="<i4")
        dense = lookup[sparse]
    return dense, keys


def column_arrays(values, typ: str):
    """(kind, data, valid) of one column, the one reading of a table's values for the wire and for a
    post-mortem record: ``kind`` is ``f8``, ``i8``, ``b1`` or ``str``; ``data`` a contiguous numpy array (a
    list of str for ``str``); ``valid`` a bool array, False where NULL, or None when no value is NULL.

    A numpy array keeps its dtype and a masked entry is NULL; a cell under the mask holds 0 (a ring slot
    no one wrote, ``numpy.ma.masked_all``'s uninitialised memory, never leaves the process). Other values
    go by the declared type (``object_column``), None being NULL.

    >>> import numpy as np
    >>> kind, data, valid = column_arrays(np.ma.masked_array([1.5, 7e300], mask=[False, True]), "DOUBLE")
    >>> kind, data.tolist(), valid.tolist()
    ('f8', [1.5, 0.0], [True, False])
    >>> column_arrays([3, None], "BIGINT")[0], column_arrays(np.arange(2), "BIGINT")[2]
    ('i8', None)
    """
    import numpy as np

    if isinstance(values, np.ndarray) and values.dtype.kind in "fiub":
        kind = {"f": "f8", "i": "i8", "u": "i8", "b": "b1"}[values.dtype.kind]
        data = np.ascontiguousarray(np.ma.getdata(values), dtype=_FIXED[kind])
        mask = np.ma.getmask(values)
        if mask is np.ma.nomask or not mask.any():
            return kind, data, None
        data = np.where(mask, np.zeros((), dtype=data.dtype), data)
        return kind, data, ~np.asarray(mask, dtype=bool)
    seq = values.tolist() if isinstance(values, np.ndarray) else list(values)
    kind, data, valid = object_column(seq, typ)
    return kind, data, None if valid.all() else valid


def _column_buffers(values, typ: str) -> tuple[str, list]:
    """The column's kind and its buffers (bytes-like), valid mask last when there are NULLs."""
    import numpy as np

    if typ == "VARCHAR" and not (isinstance(values, np.ndarray) and values.dtype.kind in "fiub"):
        found = _dictionary(values.tolist() if isinstance(values, np.ndarray) else list(values))
        if found is not None:
            codes, keys = found
            texts = [k if isinstance(k, str) else "" if k is None or k != k else str(k) for k in keys]
            valid = np.fromiter((k is not None and k == k for k in keys), bool, len(keys))
            return "dict", [codes, *_strings(texts), None if valid.all() else valid.view(np.uint8)]
    kind, data, valid = column_arrays(values, typ)
    mask = None if valid is None else valid.view(np.uint8)
    if kind == "str":
        return kind, [*_strings(data), mask]
    return kind, [data, mask]


def encode(tables: dict, meta: dict, max_bytes: int | None = None) -> list:
    """The message for ``tables`` (``{name: ([(column, type)], {column: values})}``) as a list of buffers.

    Raises ``OverflowError`` naming the table when the buffers would pass ``max_bytes``.

    >>> import numpy as np
    >>> tables = {"t.x": ([("a", "BIGINT"), ("b", "VARCHAR")], {"a": np.arange(2), "b": ["x", None]})}
    >>> msg = b"".join(bytes(b) for b in encode(tables, {}))
    >>> t = decode(msg)["tables"]["t.x"]
    >>> t["rows"], t["columns"]["a"]["data"].tolist(), t["columns"]["b"]["data"].tolist()
    (2, [0, 1], ['x', None])
    """
    header_tables: dict = {}
    buffers: list = []
    offset = 0
    for name, (columns, data) in tables.items():
        cols = []
        rows = None
        for col, typ in columns:
            values = data[col]
            kind, bufs = _column_buffers(values, typ)
            n = len(values)
            rows = n if rows is None else rows
            spans = []
            for b in bufs:
                if b is None:
                    spans.append(None)
                    continue
                size = b.nbytes if hasattr(b, "nbytes") else len(b)
                spans.append([offset, size])
                buffers.append(b)
                offset += size
                if max_bytes is not None and offset > max_bytes:
                    raise OverflowError(name)
            cols.append({"name": col, "type": typ, "kind": kind, "buffers": spans})
        header_tables[name] = {"rows": rows or 0, "columns": cols}
    header = json.dumps({"meta": meta, "tables": header_tables}, default=str).encode()
    return [MAGIC + struct.pack("<I", len(header)) + header, *buffers]


def _texts(ends_buf, blob_buf, n: int, valid):
    """An object array of ``n`` str from end offsets and UTF-8 bytes; None where not valid."""
    import numpy as np

    ends = np.frombuffer(ends_buf, "<i8", n)
    blob = bytes(blob_buf)
    if n and (ends[0] < 0 or ends[-1] > len(blob) or (n > 1 and bool((ends[1:] < ends[:-1]).any()))):
        # offsets that go back would hand out the same bytes again: the decoded text could pass the message many times
        raise WireError("the snapshot is damaged (text offsets out of order or past their bytes)")
    starts = np.concatenate(([0], ends[:-1])) if n else ends
    data = np.empty(n, dtype=object)
    data[:] = [blob[s:e].decode("utf-8", "surrogatepass") for s, e in zip(starts.tolist(), ends.tolist())]
    if valid is not None:
        data[~valid] = None
    return data


def decode(message: bytes) -> dict:
    """``{"meta": {...}, "tables": {name: {"rows": n, "columns": {col: {"type", "data", "valid"}}}}}``.

    ``data`` is a numpy array (an object array of str for text, None where NULL); ``valid``
    is a bool array or None when the column has no NULLs.
    """
    if len(message) < 8 or message[:4] != MAGIC:
        raise WireError("not a probe snapshot")
    (hlen,) = struct.unpack_from("<I", message, 4)
    try:
        header = json.loads(message[8 : 8 + hlen])
    except (ValueError, RecursionError):
        raise WireError("the snapshot header is damaged") from None
    try:
        return _decode(message, header, 8 + hlen)
    except WireError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError):
        raise WireError("the snapshot header is damaged") from None


def _decode(message: bytes, header: dict, base: int) -> dict:
    import numpy as np

    if not isinstance(header, dict) or not isinstance(header.get("tables"), dict):
        raise WireError("the snapshot header is damaged")
    view = memoryview(message)
    out: dict = {}
    for name, t in header["tables"].items():
        n = int(t["rows"])
        if n < 0 or (n and not t["columns"]):  # rows are bounded by their columns' buffers; none without columns
            raise WireError("the snapshot header is damaged")
        check_table(name, [(c["name"], c["type"]) for c in t["columns"]])
        cols: dict = {}
        for c in t["columns"]:
            spans = c["buffers"]
            if c["kind"] not in _KINDS:
                raise WireError("the snapshot header is damaged (an unknown column kind)")

            def buf(span):
                start, size = int(span[0]), int(span[1])
                if start < 0 or size < 0 or base + start + size > len(message):
                    raise WireError("the snapshot is cut short")
                return view[base + start : base + start + size]

            valid = None
            if c["kind"] == "dict":
                codes = np.frombuffer(buf(spans[0]), "<i4", n)
                nkeys = spans[1][1] // 8
                keys = _texts(
                    buf(spans[1]),
                    buf(spans[2]),
                    nkeys,
                    None if spans[3] is None else np.frombuffer(buf(spans[3]), np.uint8, nkeys).astype(bool),
                )
                if n and (codes.min() < 0 or codes.max() >= nkeys):
                    raise WireError("the snapshot is damaged (a text code out of range)")
                data = keys[codes]
            elif c["kind"] == "str":
                if spans[-1] is not None:
                    valid = np.frombuffer(buf(spans[-1]), np.uint8, n).astype(bool)
                data = _texts(buf(spans[0]), buf(spans[1]), n, valid)
                valid = None
            else:
                if spans[-1] is not None:
                    valid = np.frombuffer(buf(spans[-1]), np.uint8, n).astype(bool)
                data = np.frombuffer(buf(spans[0]), _FIXED[c["kind"]], n)
            cols[c["name"]] = {"type": c["type"], "kind": c["kind"], "data": data, "valid": valid}
        out[name] = {"rows": n, "columns": cols}
    meta = header.get("meta", {})
    return {"meta": meta if isinstance(meta, dict) else {}, "tables": out}
