"""Rendering of results: tables through DuckDB's box renderer, JSON, CSV, and backtraces."""

from __future__ import annotations

import io
import json
import shutil

TYPE_CHECKING = False  # (typing itself costs ~3 ms of start-up)
if TYPE_CHECKING:  # the renderer is on the start-up path of every command: import only what runs
    from probe.sql.engine import Result

__all__ = ["render_result", "render_backtrace", "FORMATS"]

FORMATS = ("table", "json", "csv")


def _table(result: "Result", max_rows: int) -> str:
    from probe.sql.engine import connect, register_result

    con = connect()
    try:
        register_result(con, "result", result)
        rel = con.sql("SELECT * FROM result")
        width = shutil.get_terminal_size((160, 24)).columns
        buf = io.StringIO()
        import contextlib

        with contextlib.redirect_stdout(buf):
            rel.show(max_width=width, max_rows=max_rows, null_value="NULL")
        return buf.getvalue().rstrip("\n")
    finally:
        con.close()


def render_result(result: "Result", fmt: str = "table", *, expanded: bool = False, timing: bool = False) -> str:
    if fmt == "json":
        rows = [dict(zip(result.columns, r)) for r in result.rows]
        return json.dumps(rows, indent=2, default=str)
    if fmt == "csv":
        import csv

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(result.columns)
        w.writerows(result.rows)
        return buf.getvalue().rstrip("\n")
    if expanded:
        width = max((len(c) for c in result.columns), default=0)
        parts = []
        for i, r in enumerate(result.rows, 1):
            parts.append(f"-[ RECORD {i} ]" + "-" * 20)
            parts.extend(f"{c.ljust(width)} | {'NULL' if v is None else v}" for c, v in zip(result.columns, r))
        text = "\n".join(parts) or "(0 rows)"
    else:
        text = _table(result, max_rows=max(len(result.rows), 1))
    notes = []
    if result.truncated:
        notes.append(f"only the first {len(result.rows)} rows are shown; raise --max-rows for more")
    if timing:
        notes.append(f"{len(result.rows)} rows in {result.elapsed * 1000:.1f} ms")
    return text + ("\n(" + "; ".join(notes) + ")" if notes else "")


def _frame_line(f: dict, show_line: bool = True) -> str:
    where = f"{f.get('file')}:{f.get('lineno')}" if f.get("lineno") else f"{f.get('file')}"
    text = f"    #{f.get('depth', 0):<3} {f.get('func')} ({where})"
    if show_line and f.get("line"):
        text += f"\n          {f['line']}"
    if f.get("native"):
        text += "  [native]"
    for k, v in (f.get("locals") or {}).items():
        text += f"\n          {k} = {v}"
    return text


def render_backtrace(doc: dict) -> str:
    """Threads with their frames, innermost first, main thread on top."""
    lines = []
    if doc.get("note"):
        lines.append(doc["note"])
    who = f"pid {doc.get('pid')}" + (f", rank {doc['rank']}" if doc.get("rank") is not None else "")
    lines.append(f"Backtrace of {who} (innermost frame first):")
    for t in doc.get("threads", []):
        flags = ", ".join(x for x in ("main" if t.get("is_main") else "", "daemon" if t.get("daemon") else "",
                                      t.get("state") or "") if x)
        lines.append("")
        if t.get("pid") not in (None, doc.get("pid")):  # a child process (--subprocesses)
            flags = ", ".join(x for x in (f"pid {t['pid']}", flags) if x)
        lines.append(f"Thread {t.get('native_id') or t.get('thread_id')} \"{t.get('name') or '?'}\"" + (f" ({flags})" if flags else ""))
        frames = t.get("frames") or []
        if not frames:
            lines.append("    (no Python frames)")
        lines.extend(_frame_line(f) for f in frames)
    return "\n".join(lines)
