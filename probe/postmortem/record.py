"""Post-mortem records: what a process leaves in its runtime directory when it dies.

docs/postmortem.md ("The record") gives the format, for readers without probe: a folder
``postmortem/<pid>/`` with ``meta.json`` and ``tables.npz``, never pickled, copied to the
registry too with ``PROBE_REGISTRY``. ``python.backtrace`` in it is built from the same stacks
as ``meta.json``'s: the thread that died of an exception shows that exception's traceback, and
the snapshot thread leaves itself out.

Writes are atomic (a temporary folder renamed into place), and at most ``PROBE_POSTMORTEM_KEEP`` records are
kept (``retention``). SIGKILL leaves no chance to write, so the periodic snapshot (``hooks``) writes the same
record with cause ``snapshot``; reading records back and saying how each process ended is the CLI's
(``probe.cli.plumbing``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import traceback

from ..config import setting
from .._errors import ProbeError
from .._runtime import runtime_dir
from ..util.errorlog import record_error
from ..util.procfs import proc_start
from .retention import prune


# The tables a record keeps: the rings (the last minutes of the run), who/what the process was, and where its
# collectives stood (the flight recorder), so a dead rank still lines up with the live ones in ranks.*.
TABLES = (
    "torch.steps",
    "torch.optimizer_steps",  # each optimizer's loss and lr when several step per iteration (a GAN)
    "python.torch_trace",
    "probe.actions",
    "probe.errors",
    "process.info",
    "torch.optimizer",
    "torch.memory",
    "python.backtrace",
    "torch.collectives",
    "torch.process_groups",
)
_OWN_FILES = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)  # frames of this package: the writer itself

_write_lock = threading.Lock()
_thread_deaths: list = []  # worker threads that died of an exception: every later record keeps them
# "ended": the pid that wrote a record of how it ends (no periodic snapshot replaces it); "start": (pid, proc_start)
_process: dict = {}
_FINAL = ("exception", "interrupted", "exit", "terminated")  # causes that say how the process ends


def records_dir(create: bool = True) -> str:
    path = os.path.join(runtime_dir(create=create), "postmortem")
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _frames(summary) -> list:
    """``traceback.StackSummary`` (outermost first) as frame dicts, innermost first."""
    return [{"func": f.name, "file": f.filename, "lineno": f.lineno, "line": f.line or None} for f in reversed(summary)]


def _stacks(exc: BaseException | None, skip_self: bool, frame=None) -> list:
    """Every thread's stack, innermost frame first. The thread writing the record: the traceback of
    ``exc`` when it is dying of it, itself left out when ``skip_self`` (the snapshot thread, the
    SIGTERM writer), else its stack without this package's frames. ``frame``: the frame a signal
    handler interrupted, the main thread's stack (not the handler waiting for the writer)."""
    names = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    main = threading.main_thread().ident
    out = []
    for ident, current in sys._current_frames().items():
        if ident == me and skip_self:
            continue
        t = names.get(ident)
        if t is not None and t.name == "probe-sigterm":
            continue  # the SIGTERM watcher waiting for this writer: the probe's, not the process's
        if ident == me and exc is not None and exc.__traceback__ is not None:
            frames = _frames(traceback.extract_tb(exc.__traceback__))
        else:
            frames = _frames(traceback.extract_stack(frame if ident == main and frame is not None else current))
            if ident == me:
                while frames and frames[0]["file"].startswith(_OWN_FILES):
                    frames.pop(0)
        out.append(
            {
                "thread_id": ident,
                "name": t.name if t else None,
                "is_main": ident == main,
                "daemon": t.daemon if t else None,
                "frames": frames,
            }
        )
    out.sort(key=lambda t: not t["is_main"])
    return out


def backtrace_columns(stacks: list) -> dict:
    """python.backtrace's columns from ``stacks`` (so the table and meta.json's stacks agree)."""
    keys = ("thread_id", "thread_name", "is_main", "depth", "func", "file", "lineno", "line", "is_native")
    rows = [
        (t["thread_id"], t["name"], t["is_main"], depth, f["func"], f["file"], f["lineno"], f.get("line"), False)
        for t in stacks
        for depth, f in enumerate(t["frames"])
    ]
    return {k: [row[i] for row in rows] for i, k in enumerate(keys)}


def _columns(name: str, rows: int, data: dict | None = None) -> dict | None:
    """``{column: numpy array}`` of table ``name`` (its last ``rows`` rows), or None when absent.

    Each column is read as the wire reads it (``wire.column_arrays``: a masked entry or a None is
    NULL, a NaN is a value), text stored as a unicode array, and a column with NULLs gets
    ``<column>.valid`` (false where NULL): a reader restores exactly what a live query returns.
    """
    import numpy as np

    from ..tables.registry import Context, get_table, to_columns
    from ..util.wire import column_arrays

    tbl = get_table(name)
    if tbl is None:
        return None
    if data is None:
        data = to_columns(tbl, tbl.generator(Context()))
    out = {}
    rows_in = len(next(iter(data.values()), ()))
    for col in tbl.columns:
        values = data.get(col.name)
        if values is None:  # a column the given data lacks: NULL
            values = [None] * rows_in
        if not isinstance(values, np.ndarray):
            values = list(values)
        kind, array, valid = column_arrays(values[-rows:], col.type)
        out[col.name] = np.array(array, dtype=str) if kind == "str" else array
        if valid is not None:
            out[col.name + ".valid"] = valid
    return out


def shared_records_dir(create: bool = True) -> str | None:
    """``<PROBE_REGISTRY>/postmortem`` (records named ``<host>-<pid>``), or None without a shared registry
    this user may trust (``shared_registry`` refuses one that others can write, and says why once)."""
    from .._runtime import check_private_dir, shared_registry

    base = shared_registry(create=create)
    if base is None:
        return None
    path = os.path.join(base, "postmortem")
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        check_private_dir(path, "the shared registry's post-mortem folder", "remove it")
    except (OSError, ProbeError):
        return None
    return path


MAX_TABLES_BYTES = 256 << 20  # what one record's tables may decompress to (probe writes them uncompressed)
_MAX_MEMBERS = 20000


def load_tables(folder: str) -> dict:
    """``{"<table>/<column>": array}`` from a record's tables.npz, bounded before anything is decompressed.

    The file must be a private file of this user; its members may declare at most
    ``MAX_TABLES_BYTES`` in all, none may inflate more than 4x (probe stores them, a zip bomb
    deflates), each array's header must fit its member, and nothing is unpickled. Raises
    ValueError (or OSError) otherwise.
    """
    import stat
    import zipfile

    import numpy as np

    fd = os.open(os.path.join(folder, "tables.npz"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o022:
            raise ValueError("tables.npz is not a private file of this user")
        with zipfile.ZipFile(f) as z:
            infos = [i for i in z.infolist() if i.filename.endswith(".npy")]
            if len(infos) > _MAX_MEMBERS or sum(i.file_size for i in infos) > MAX_TABLES_BYTES:
                raise ValueError(f"tables.npz would decompress past {MAX_TABLES_BYTES >> 20} MiB")
            out = {}
            for info in infos:
                if info.file_size > 4 * info.compress_size + (1 << 16):
                    raise ValueError(f"{info.filename} inflates {info.file_size} bytes from {info.compress_size}")
                with z.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read_header = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read_header(member)
                    size = int(np.prod(shape, dtype=object)) * dtype.itemsize
                    if dtype.hasobject or size > info.file_size:
                        raise ValueError(f"{info.filename} declares {size} bytes in a {info.file_size}-byte member")
                with z.open(info) as member:
                    out[info.filename[:-4]] = np.lib.format.read_array(member, allow_pickle=False)
            return out


def _share(final: str, host: str, pid: int) -> None:
    """Copy the record into the shared registry (other nodes' CLIs read it there); a failure is only recorded."""
    try:
        base = shared_records_dir()
        if base is None:
            return
        import tempfile

        tmp = tempfile.mkdtemp(prefix=f".tmp-{host}-{pid}-", dir=base)  # 0700, a name no one can prepare
        shutil.copytree(final, tmp, dirs_exist_ok=True)
        _replace_dir(tmp, os.path.join(base, f"{host}-{pid}"))
        prune(base, setting("PROBE_POSTMORTEM_KEEP"), prefix=f"{host}-")
    except Exception as err:
        record_error("post-mortem record (shared registry)", err)


def _replace_dir(tmp: str, dest: str) -> None:
    """Put the folder ``tmp`` in place of ``dest`` (a reader sees the old record or the new one, never half)."""
    old = dest + f".old-{threading.get_ident()}"
    if os.path.isdir(dest):
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def _schema() -> dict:
    """Every registered table's declaration (not only those stored): a reader gives a table the dead
    process did not keep its declared, empty columns beside the live ranks'."""
    from ..tables.registry import all_tables

    return {
        t.name: {
            "description": t.description,
            "kind": t.kind,
            "examples": list(t.examples),
            "columns": [[c.name, c.type, c.description] for c in t.columns],
        }
        for t in all_tables()
    }


def _own_start() -> int | None:
    """This process's start time (``procfs.proc_start``), read once per process."""
    pid = os.getpid()
    if _process.get("start", (None,))[0] != pid:
        _process["start"] = (pid, proc_start())
    return _process["start"][1]


def write(
    cause: str,
    exc: BaseException | None = None,
    *,
    thread: str | None = None,
    detail: str | None = None,
    frame=None,
    exit_code: int | None = None,
    tables=TABLES,
) -> str | None:
    """Write (or replace) this process's record; return its folder, or None when that failed (or when
    ``cause`` is ``snapshot`` and a record of how the process ends is already written).

    ``frame``: the frame a signal interrupted (the main thread's stack at a SIGTERM); ``exit_code``: the
    code of ``sys.exit(N)`` when it is known. Never raises: a process dying must die of its own error,
    not of the probe's.
    """
    try:
        import numpy as np

        from .._core import state

        with _write_lock:
            pid = os.getpid()
            if cause == "snapshot" and _process.get("ended") == pid:
                return None  # a periodic snapshot must not replace the record of the death
            rows = setting("PROBE_POSTMORTEM_ROWS")
            base = records_dir()
            tmp = os.path.join(base, f".tmp-{pid}-{threading.get_ident()}")
            shutil.rmtree(tmp, ignore_errors=True)
            os.mkdir(tmp, 0o700)
            stacks = _stacks(exc, cause in ("snapshot", "terminated"), frame)
            arrays, written = {}, []
            for name in tables:
                try:
                    found = _columns(name, rows, backtrace_columns(stacks) if name == "python.backtrace" else None)
                except Exception as err:  # one table failing must not lose the others
                    record_error(f"post-mortem table {name}", err)
                    continue
                if found is None:
                    continue
                written.append(name)
                arrays.update({f"{name}/{c}": v for c, v in found.items()})
            fd = os.open(os.path.join(tmp, "tables.npz"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            entry = state.info()
            entry.pop("key", None)
            if cause == "thread_exception" and exc is not None:
                _thread_deaths.append({"thread": thread, "type": type(exc).__name__, "message": str(exc)})
            meta = {
                "format": 1,
                "cause": cause,
                "time": time.time(),
                "pid": pid,
                "rank": entry.get("rank"),
                "world_size": entry.get("world_size"),
                "job": entry.get("job"),
                "host": socket.gethostname(),
                "argv": entry.get("argv") or list(sys.argv),
                "started_at": entry.get("started_at"),
                "proc_start": _own_start(),
                "exit_code": exit_code,
                "thread": thread,
                "detail": detail,
                "tables": written,
                "schema": _schema(),
                "thread_deaths": list(_thread_deaths),
                "exception": None
                if exc is None
                else {
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                },
                "stacks": stacks,
            }
            fd = os.open(os.path.join(tmp, "meta.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(meta, f, default=str)
            final = os.path.join(base, str(pid))
            _replace_dir(tmp, final)
            if cause in _FINAL:
                _process["ended"] = pid
            prune(base, setting("PROBE_POSTMORTEM_KEEP"), fatal_dir=runtime_dir(create=False))
            _share(final, meta["host"], pid)
            return final
    except Exception as err:
        record_error("post-mortem record", err)
        return None
