"""Rendering of results: box-drawn tables, JSON, CSV, and backtraces (no DuckDB: the CLI starts fast).

Every string a process or an endpoint chose reaches a terminal escaped (``probe.util.printable`` says why):
``escape_controls`` escapes one value (newlines and tabs too: they break a table's layout); ``terminal_text``
is the net every human-readable line goes through (``Session.print``/``note`` and the CLI's error line), which
keeps the newlines and tabs of the layout. JSON stays exact: ``json.dumps`` escapes controls itself.
"""

from __future__ import annotations

import io
import json

from probe.util.printable import escape_controls

TYPE_CHECKING = False  # (typing itself costs ~3 ms of start-up)
if TYPE_CHECKING:  # the renderer is on the start-up path of every command: import only what runs
    from probe.sql.engine import Result


FORMATS = ("table", "json", "csv")


_TYPE_NAMES = {
    "BIGINT": "int64",
    "INTEGER": "int32",
    "DOUBLE": "double",
    "VARCHAR": "varchar",
    "BOOLEAN": "boolean",
    "TIMESTAMP": "timestamp",
    "FLOAT": "float",
    "SMALLINT": "int16",
    "TINYINT": "int8",
    "HUGEINT": "int128",
}
_NUMERIC = ("BIGINT", "INTEGER", "DOUBLE", "FLOAT", "SMALLINT", "TINYINT", "HUGEINT", "UBIGINT", "UINTEGER", "DECIMAL")


def _cell(value, typ: str) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return repr(value)  # shortest round-trip form; nan and inf as Python spells them
    if hasattr(value, "isoformat") and not isinstance(value, str):
        return str(value)
    return escape_controls(value)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _table(result: "Result", max_width: int | None = None) -> str:
    """A box-drawn table (names, types, rows), numbers right-aligned; wide columns are cut with '…' to fit."""
    width = max_width
    if not width:
        import shutil  # here, not at the top: it imports bz2, lzma and zlib, which a backtrace never needs

        width = shutil.get_terminal_size((160, 24)).columns
    cols = [escape_controls(c) for c in result.columns]
    types = [str(t).split("(")[0].upper() for t in result.types] + ["VARCHAR"] * (len(cols) - len(result.types))
    cells = [[_cell(v, t) for v, t in zip(row, types)] for row in result.rows]
    tnames = [_TYPE_NAMES.get(t, t.lower()) for t in types]
    widths = [max([len(c), len(tn)] + [len(r[i]) for r in cells]) for i, (c, tn) in enumerate(zip(cols, tnames))]
    budget = width - (3 * len(cols) + 1)
    while sum(widths) > budget and max(widths, default=0) > 8:  # shrink the widest column until the table fits
        i = widths.index(max(widths))
        widths[i] = max(8, widths[i] - max(1, sum(widths) - budget))
    right = [t in _NUMERIC for t in types]

    def line(left, mid, end):
        return left + mid.join("─" * (w + 2) for w in widths) + end

    def row(values, align_right=None, center=False):
        parts = []
        for i, (v, w) in enumerate(zip(values, widths)):
            v = _fit(v, w)
            parts.append(v.center(w) if center else v.rjust(w) if align_right and align_right[i] else v.ljust(w))
        return "│ " + " │ ".join(parts) + " │"

    if not cols:
        return "(no columns)"
    out = [line("┌", "┬", "┐"), row(cols, center=True), row(tnames, center=True), line("├", "┼", "┤")]
    out += [row(r, right) for r in cells]
    if not cells:
        empty = "0 rows"
        out.append("│ " + empty.center(sum(widths) + 3 * (len(widths) - 1)) + " │")
    out.append(line("└", "┴", "┘"))
    return "\n".join(out)


def render_result(result: "Result", fmt: str = "table", *, expanded: bool = False, timing: bool = False) -> str:
    if fmt == "json":
        rows = [dict(zip(result.columns, r)) for r in result.rows]
        return json.dumps(rows, indent=2, default=str)
    if fmt == "csv":
        import csv

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow([escape_controls(c) for c in result.columns])  # every value kept, its controls escaped
        w.writerows([escape_controls(v) if isinstance(v, str) else v for v in row] for row in result.rows)
        return buf.getvalue().rstrip("\n")
    if expanded:
        cols = [escape_controls(c) for c in result.columns]
        width = max((len(c) for c in cols), default=0)
        parts = []
        for i, r in enumerate(result.rows, 1):
            parts.append(f"-[ RECORD {i} ]" + "-" * 20)
            parts.extend(f"{c.ljust(width)} | {_cell(v, '')}" for c, v in zip(cols, r))
        text = "\n".join(parts) or "(0 rows)"
    else:
        text = _table(result)
    notes = []
    if result.truncated:
        notes.append(f"only the first {len(result.rows)} rows are shown; raise --max-rows for more")
    if timing:
        notes.append(f"{len(result.rows)} rows in {result.elapsed * 1000:.1f} ms")
    return text + ("\n(" + "; ".join(notes) + ")" if notes else "")


def render_rows(columns: list, types: list, rows: list, fmt: str = "table") -> str:
    """Rows the CLI made itself (a listing, not a query's answer), rendered as a query's result is."""
    from probe.sql.engine import Result

    return render_result(Result(columns, types, rows), fmt)


def frame_line(f: dict, show_line: bool = True) -> str:
    """One frame: ``#depth func (file:line)``, its source line and locals below, every field escaped."""
    e = escape_controls
    where = f"{e(f.get('file'))}:{e(f.get('lineno'))}" if f.get("lineno") else e(f.get("file"))
    text = f"    #{e(f.get('depth', 0)):<3} {e(f.get('func'))} ({where})"
    if show_line and f.get("line"):
        text += f"\n          {e(f['line'])}"
    if f.get("native"):
        text += "  [native]"
    for k, v in (f.get("locals") or {}).items():
        text += f"\n          {e(k)} = {e(v)}"
    return text


def render_backtrace(doc: dict) -> str:
    """Threads with their frames, innermost first, main thread on top."""
    lines = []
    if doc.get("note"):
        lines.append(doc["note"])
    who = f"pid {doc.get('pid')}" + (f", rank {doc['rank']}" if doc.get("rank") is not None else "")
    lines.append(f"Backtrace of {who} (innermost frame first):")
    for t in doc.get("threads", []):
        flags = ", ".join(
            x
            for x in ("main" if t.get("is_main") else "", "daemon" if t.get("daemon") else "", t.get("state") or "")
            if x
        )
        flags = escape_controls(flags)
        lines.append("")
        if t.get("pid") not in (None, doc.get("pid")):  # a child process (--subprocesses)
            flags = ", ".join(x for x in (f"pid {t['pid']}", flags) if x)
        ident, name = escape_controls(t.get("native_id") or t.get("thread_id")), escape_controls(t.get("name") or "?")
        lines.append(f'Thread {ident} "{name}"' + (f" ({flags})" if flags else ""))
        frames = t.get("frames") or []
        if not frames:
            lines.append("    (no Python frames)")
        lines.extend(frame_line(f) for f in frames)
        if t.get("frames_left_out"):
            lines.append(f"    ... {escape_controls(t['frames_left_out'])} outer frames not shown")
    lines.extend(_left_out_lines(doc))
    return "\n".join(lines)


def _left_out_lines(doc: dict) -> list:
    """What the process left out of its answer to bound its cost: threads past its limit, locals past its deadline
    (every field escaped: the answer is the process's)."""
    e = escape_controls
    lines = []
    rest = doc.get("left_out")
    if isinstance(rest, dict) and rest.get("threads"):
        count, limit = e(rest["threads"]), e(rest.get("limit"))
        lines += ["", f"[{count} more threads not shown (a backtrace shows {limit}); by where they are:"]
        where = rest.get("where")
        for w in where if isinstance(where, list) else []:
            if isinstance(w, dict):
                at = f"{e(w.get('func'))} ({e(w.get('file'))}:{e(w.get('lineno'))})"
                lines.append(f"    {e(w.get('threads'))} in {at}")
        lines.append('  `query "SELECT * FROM python.backtrace"` reads every thread\'s stack]')
    if doc.get("locals_left_out"):
        within = e(doc["locals_left_out"])
        lines += ["", f"[locals are shown for the frames read within {within} s; later frames have none]"]
    return lines
