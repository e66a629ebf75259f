"""torch's c10d flight recorder: turned on at start, read at query time.

The flight recorder is torch's own ring of the collectives each process group issued
(op, sizes, dtypes, sequence ids, state, the Python frames that issued it). It records
only when ``TORCH_FR_BUFFER_SIZE`` is set before the first process group is created,
so ``enable()`` (called when the probe starts, before the training script reaches
``init_process_group`` under PROBE=1 or an early ``import probe.auto``) sets it to
PROBE_COLLECTIVES entries when the user has not set it. Nothing here imports torch:
the recorder is read only when ``torch.distributed`` is already loaded, and only on
the server thread, at query time.

Reading it costs one dump (C++ builds the entries, then ``pickle.loads``); the hot
path pays only torch's own recording of each collective (see docs/ranks.md).
"""

from __future__ import annotations

import os
import pickle
import sys

from ..config import setting
from ..util.errorlog import record_error

__all__ = ["enable", "disable", "dump", "entry_rows", "group_rows", "split_op", "step_split"]

_ENV = "TORCH_FR_BUFFER_SIZE"


def enable() -> bool:
    """Turn the recorder on (PROBE_COLLECTIVES entries) unless the user set its buffer size; whether it did."""
    if _ENV in os.environ or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        return False
    size = setting("PROBE_COLLECTIVES")
    if size <= 0:
        return False
    if _group_exists():  # torch reads the variable when the first group is made: too late now
        record_error(
            "torch.collectives",
            RuntimeError(
                "the flight recorder is off: the process group existed before the probe started; import probe.auto "
                f"before init_process_group, run with PROBE=1, or set {_ENV} yourself"
            ),
        )
        return False
    os.environ[_ENV] = str(size)
    return True


def disable() -> None:
    """Undo ``enable`` while no process group has read the setting yet (a group made since keeps its recorder)."""
    if not _group_exists():
        os.environ.pop(_ENV, None)


def _group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def dump(frames: bool = True, collectives: bool = True, only_active: bool = False) -> dict | None:
    """The recorder's content as a dict, or None without torch.distributed or a process group."""
    if not _group_exists():
        return None
    c10d = sys.modules.get("torch._C._distributed_c10d")
    fn = getattr(c10d, "_dump_fr_trace", None)
    if fn is None:
        return None
    try:
        raw = fn(includeCollectives=collectives, includeStackTraces=frames, onlyActive=only_active)
        return pickle.loads(raw)
    except Exception as exc:
        record_error("torch.collectives: reading the flight recorder", exc)
        return None


def split_op(profiling_name: str | None) -> tuple[str | None, str | None]:
    """``("gloo", "all_reduce")`` from the recorder's ``gloo:all_reduce``.

    >>> split_op("nccl:all_gather_into_tensor_coalesced")
    ('nccl', 'all_gather_into_tensor_coalesced')
    >>> split_op("barrier")
    (None, 'barrier')
    """
    if not profiling_name:
        return None, None
    backend, sep, op = profiling_name.partition(":")
    return (backend, op) if sep else (None, backend)


def _ns(v) -> float | None:
    return v / 1e9 if v else None


_PROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # probe/ (this file is in probe/training)


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    return os.path.dirname(os.path.abspath(torch.__file__)) if torch is not None else None


def _frame_text(f: dict) -> str:
    return f"{f.get('name')} ({os.path.basename(str(f.get('filename')))}:{f.get('line')})"


# probe's wrappers that a user's call passes through on its way to torch (its backward, GradScaler.scale,
# clip_grad_norm_, a probe.span): a collective below them is the user's
_PASS_THROUGH = {
    ("capture.py", "backward"),
    ("capture.py", "scale_"),
    ("capture.py", "clip_grad_norm_"),
    ("spans.py", "wrapper"),
    ("spans.py", "async_wrapper"),
}


def call_site(frames: list, tdir: str | None = None) -> str | None:
    """The innermost issuing frame outside torch, ``func (file:line)``; ``probe: func (file:line)`` when it
    is the probe's own work (a table, an action, an eval), never credited to the user's frame below it.

    >>> call_site([{"name": "all_reduce", "filename": "/t/torch/c10d.py", "line": 9},
    ...            {"name": "main", "filename": "/u/train.py", "line": 25}], "/t/torch")
    'main (train.py:25)'
    """
    if tdir is None:
        tdir = _torch_dir()
    for f in frames:
        name = str(f.get("filename", ""))
        if tdir and name.startswith(tdir + os.sep):
            continue
        if _PROBE_DIR and name.startswith(_PROBE_DIR + os.sep):
            if (os.path.basename(name), f.get("name")) in _PASS_THROUGH:
                continue
            return "probe: " + _frame_text(f)
        return _frame_text(f)
    return None


def entry_rows(doc: dict | None) -> list[dict]:
    """One row per recorded collective, oldest first (the torch.collectives columns)."""
    if not doc:
        return []
    tdir = _torch_dir()
    rows = []
    for e in doc.get("entries") or []:
        backend, op = split_op(e.get("profiling_name"))
        pg = e.get("process_group") or ("", "")
        started, completed = _ns(e.get("time_discovered_started_ns")), _ns(e.get("time_discovered_completed_ns"))
        duration = e.get("duration_ms")
        if duration is not None:
            duration = duration / 1000.0
        elif started and completed:
            duration = completed - started
        frames = e.get("frames") or []
        site = call_site(frames, tdir)
        state = e.get("state")
        rows.append(
            {
                "pg": str(pg[0]),
                "pg_desc": str(pg[1]) if len(pg) > 1 else None,
                "record_id": e.get("record_id"),
                "seq": None if e.get("is_p2p") else e.get("collective_seq_id"),
                "p2p_seq": e.get("p2p_seq_id") if e.get("is_p2p") else None,
                "op_id": e.get("op_id"),
                "is_p2p": bool(e.get("is_p2p")),
                "backend": backend,
                "op": op,
                "input_sizes": _text(e.get("input_sizes")),
                "input_dtypes": _text(e.get("input_dtypes")),
                "output_sizes": _text(e.get("output_sizes")),
                "output_dtypes": _text(e.get("output_dtypes")),
                "state": "completed" if e.get("retired") and state != "completed" else state,
                "retired": bool(e.get("retired")),
                "created_at": _ns(e.get("time_created_ns")),
                "started_at": started,
                "completed_at": completed,
                "duration": duration,
                "timeout_s": (e.get("timeout_ms") or 0) / 1000.0 or None,
                "thread": e.get("thread_name"),
                "call_site": site,
                "frames": "; ".join(_frame_text(f) for f in frames) if frames else None,
            }
        )
    return rows


def _text(v) -> str | None:
    return None if v is None else str(v).replace("'", "")


def group_rows(doc: dict | None) -> list[dict]:
    """One row per process group: its ranks and its last enqueued, started and completed sequence ids."""
    if not doc:
        return []
    status = doc.get("pg_status") or {}
    config = doc.get("pg_config") or {}
    descs = {}
    for e in doc.get("entries") or []:
        pg = e.get("process_group") or ()
        if len(pg) > 1:
            descs[str(pg[0])] = str(pg[1])
    rows = []
    for pg_id, st in status.items():
        cfg = config.get(str(pg_id)) or {}
        if not cfg and len(config) == 1 and len(status) == 1:  # torch names the default group '' in pg_config
            cfg = next(iter(config.values())) or {}
        rows.append(
            {
                "pg": str(pg_id),
                "pg_desc": cfg.get("desc") or descs.get(str(pg_id)),
                "ranks": str(cfg.get("ranks")) if cfg.get("ranks") is not None else None,
                "last_enqueued": _int(st.get("last_enqueued_collective")),
                "last_started": _int(st.get("last_started_collective")),
                "last_completed": _int(st.get("last_completed_collective")),
            }
        )
    return rows


def _int(v) -> int | None:
    try:
        v = int(v)
    except (TypeError, ValueError):
        return None
    return v if v >= 0 else None


def step_split(started, ended, created) -> tuple:
    """Per step: (compute, comm_wait) seconds from the creation times of its collectives.

    ``started``/``ended`` are the steps' boundaries, ``created`` the sorted creation times
    of the collectives, all epoch seconds. In a synchronous step every collective is
    issued by this rank's own work (data, forward, backward); the last one issued ends
    the rank's compute, and from there to the step's end it waits for the others (plus
    its optimizer step). Steps without a recorded collective get NaN.

    >>> step_split([0.0, 1.0], [1.0, 2.5], [0.2, 0.7, 1.4, 2.0])
    ([0.7, 1.0], [0.30000000000000004, 0.5])
    """
    import bisect

    compute, wait = [], []
    for s, e in zip(started, ended):
        i = bisect.bisect_left(created, e) - 1
        if i < 0 or created[i] < s:
            compute.append(float("nan"))
            wait.append(float("nan"))
        else:
            compute.append(created[i] - s)
            wait.append(e - created[i])
    return compute, wait
