"""What the job is built on: framework adapters, sharded tensors and torch's c10d flight recorder.

A Lightning ``Trainer``, a transformers ``Trainer`` and an accelerate ``Accelerator`` are recognised by module and
class name (``framework_of``: nothing here imports torch or a framework); ``framework_items`` lists what each
holds, ``unwrap_optimizer``/``unwrap_scheduler`` reach the object that owns the state through a wrapper.

Under FSDP2 parameters, gradients and optimizer state are DTensors, and any reduction of one is a collective
issued on this rank alone (the job hangs). The probe reads the local shard instead (``_local_tensor``, no
communication) and says its figures are this rank's (``is_sharded``, ``local``, ``placement``).

The flight recorder (torch's ring of the collectives each process group issued) records only when
``TORCH_FR_BUFFER_SIZE`` is set before the first process group is made: ``enable()`` (at start) sets it to
PROBE_COLLECTIVES entries unless the user did; it is read (one ``dump``) on the server thread at query time only.
"""

from __future__ import annotations

import bisect
import os
import pickle
import sys
from typing import Any

from ..config import setting
from ..util.errorlog import record_error
from ..util.objects import instance_dict, is_a

_FRAMEWORK_TYPES = {
    ("lightning.pytorch.trainer.trainer", "Trainer"): "lightning",
    ("pytorch_lightning.trainer.trainer", "Trainer"): "lightning",
    ("transformers.trainer", "Trainer"): "transformers",
    ("accelerate.accelerator", "Accelerator"): "accelerate",
}
_LIGHTNING_MODULES = {
    ("lightning.pytorch.core.module", "LightningModule"),
    ("pytorch_lightning.core.module", "LightningModule"),
}


def framework_of(obj) -> str | None:
    """ "lightning", "transformers" or "accelerate" for a framework's Trainer/Accelerator (or a subclass), else None."""
    try:
        mro = type(obj).__mro__
    except Exception:
        return None
    for cls in mro:
        kind = _FRAMEWORK_TYPES.get((cls.__module__, cls.__name__))
        if kind is not None:
            return kind
    return None


def is_lightning_module(obj) -> bool:
    """Whether ``obj`` is a LightningModule (whose ``_trainer`` leads to the Trainer)."""
    return any((c.__module__, c.__name__) in _LIGHTNING_MODULES for c in type(obj).__mro__)


def scheduler_types(torch) -> tuple:
    """torch's LR scheduler base classes (LRScheduler, ReduceLROnPlateau) present in this torch."""
    lrs = torch.optim.lr_scheduler
    return tuple(c for c in (getattr(lrs, "LRScheduler", None), getattr(lrs, "ReduceLROnPlateau", None)) if c)


def scaler_types(torch) -> tuple:
    """torch's GradScaler classes (torch.amp's and torch.cuda.amp's) present in this torch."""
    found = (getattr(getattr(mod, "amp", None), "GradScaler", None) for mod in (torch, torch.cuda))
    return tuple(t for t in found if isinstance(t, type))


def unwrap_optimizer(opt) -> tuple[Any, str | None]:
    """``(inner, wrapper class name)``: the optimizer that owns ``opt``'s param_groups.

    A wrapper is recognised by what it does, not by its name: it keeps the inner optimizer
    as ``optimizer`` or ``_optimizer`` and its ``param_groups`` is the inner one's list.
    """
    wrapper = None
    for _ in range(4):  # wrappers of wrappers (DeepSpeed inside accelerate)
        attrs = instance_dict(opt)
        if attrs is None:
            break
        inner = next((attrs[a] for a in ("_optimizer", "optimizer") if a in attrs), None)
        if inner is None or inner is opt or not hasattr(inner, "param_groups"):
            break
        try:
            same = opt.param_groups is inner.param_groups
        except Exception:
            same = False
        if not same:
            break
        wrapper = wrapper or type(opt).__name__
        opt = inner
    return opt, wrapper


def unwrap_scheduler(torch, sched):
    """The torch scheduler behind ``sched`` (accelerate's AcceleratedScheduler keeps it as ``scheduler``), or None."""
    kinds = scheduler_types(torch)
    for _ in range(3):
        if is_a(sched, kinds):
            return sched
        inner = (instance_dict(sched) or {}).get("scheduler")
        if inner is None:
            return None
        sched = inner
    return sched if is_a(sched, kinds) else None


def framework_items(obj, name: str):
    """``(value, name, kind)`` for the objects a framework object holds, by the framework's own API."""
    kind = framework_of(obj)
    if kind == "lightning":
        yield getattr(obj, "lightning_module", None), f"{name}.lightning_module", "model"
        for i, opt in enumerate(list(getattr(obj, "optimizers", None) or [])):
            yield opt, f"{name}.optimizers[{i}]", "optimizer"
        for i, cfg in enumerate(list(getattr(obj, "lr_scheduler_configs", None) or [])):
            yield getattr(cfg, "scheduler", None), f"{name}.lr_scheduler_configs[{i}].scheduler", "scheduler"
        yield from _loaders(_lightning_train_loaders(obj), f"{name}.train_dataloader")
    elif kind == "transformers":
        for attr, k in (
            ("model", "model"),
            ("optimizer", "optimizer"),
            ("lr_scheduler", "scheduler"),
            ("accelerator", "framework"),
        ):
            yield getattr(obj, attr, None), f"{name}.{attr}", k
        handler = getattr(obj, "callback_handler", None)  # the training loop's loader is set there for callbacks
        yield getattr(handler, "train_dataloader", None), f"{name}.callback_handler.train_dataloader", "dataloader"
    elif kind == "accelerate":
        for attr, k in (
            ("_models", "model"),
            ("_optimizers", "optimizer"),
            ("_schedulers", "scheduler"),
            ("_dataloaders", "dataloader"),
        ):
            for i, value in enumerate(list(getattr(obj, attr, None) or [])):
                yield value, f"{name}.{attr}[{i}]", k


def _lightning_train_loaders(trainer):
    """The fit loop's loaders as the user returned them (None before fit starts), not asking for new ones."""
    fit_loop = getattr(trainer, "fit_loop", None)
    combined = getattr(fit_loop, "_combined_loader", None) if fit_loop is not None else None
    return getattr(combined, "iterables", None) if combined is not None else None


def _loaders(value, name: str):
    """``(loader, name, "dataloader")`` for a loader, or for each loader of a list, tuple or dict of them."""
    if isinstance(value, dict):
        for key, v in list(value.items())[:20]:
            yield v, f"{name}[{key!r}]", "dataloader"
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value[:20]):
            yield v, f"{name}[{i}]", "dataloader"
    elif value is not None:
        yield value, name, "dataloader"


def objects_of(framework) -> dict:
    """The first model, optimizer (unwrapped) and scheduler (unwrapped) a framework object holds."""
    out: dict = {}
    torch = sys.modules.get("torch")
    for value, _, kind in framework_items(framework, "trainer"):
        if value is None or kind in out or kind in ("framework", "dataloader"):
            continue
        if kind == "optimizer":
            value = unwrap_optimizer(value)[0]
        elif kind == "scheduler" and torch is not None:
            value = unwrap_scheduler(torch, value)
        out[kind] = value
    return out


def framework_name(value, name: str) -> str:
    """A framework object seen as ``self`` is named for what it is (trainer, accelerator)."""
    if name != "self":
        return name
    kind = framework_of(value)
    return "accelerator" if kind == "accelerate" else "trainer" if kind else name


# -- sharded tensors ------------------------------------------------------------------------------
def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (checked by its attributes: torch.distributed need not be imported)."""
    return getattr(t, "_local_tensor", None) is not None and hasattr(t, "placements")


def local(t):
    """The tensor this rank holds of ``t`` (itself when ``t`` is an ordinary tensor); never communicates."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None and hasattr(t, "placements") else t


def placement(t) -> str | None:
    """``Shard(dim=0)``-like text of a DTensor's placements (one per mesh dimension), None for an ordinary tensor."""
    if not is_sharded(t):
        return None
    try:
        return ",".join(str(p) for p in t.placements)
    except Exception:
        return "DTensor"


# -- step counters --------------------------------------------------------------------------------
def _shift_progress(progress, completed: int) -> None:
    """Move a Lightning ``_Progress`` (its total and current trackers) so that ``current.completed`` is
    ``completed``, every field by the same amount: an epoch in progress stays in progress."""
    delta = completed - int(progress.current.completed)
    for tracker in (progress.total, progress.current):
        for field in ("ready", "started", "processed", "completed"):
            if hasattr(tracker, field):
                setattr(tracker, field, int(getattr(tracker, field)) + delta)


def restore_counters(framework, counters: dict) -> dict:
    """Set a framework object's step counters to ``counters`` (as ``framework_counters`` wrote them); return what
    was set. Lightning gets ``global_step`` and ``current_epoch`` back; a transformers Trainer its ``global_step``
    only (it recomputes ``state.epoch`` from a local of its loop); an ``Accelerator`` its ``step`` (the
    gradient-accumulation counter, restored as accelerate's own ``load_state`` does)."""
    kind = framework_of(framework)
    done = {}
    if kind == "lightning" and "global_step" in counters:
        loop = framework.fit_loop.epoch_loop
        progress = loop.automatic_optimization.optim_progress.optimizer.step.total
        progress.ready = progress.completed = int(counters["global_step"])
        loop._batches_that_stepped = int(counters["global_step"])
        done["global_step"] = int(framework.global_step)
        if "current_epoch" in counters:
            _shift_progress(framework.fit_loop.epoch_progress, int(counters["current_epoch"]))
            done["current_epoch"] = int(framework.current_epoch)
    elif kind == "transformers" and "global_step" in counters:
        framework.state.global_step = int(counters["global_step"])
        if hasattr(framework, "_globalstep_last_logged"):  # as the Trainer's own resume does: else it logs nothing
            framework._globalstep_last_logged = framework.state.global_step  # until the step count passes the old one
        done["global_step"] = framework.state.global_step
    elif kind == "accelerate" and "step" in counters:
        framework.step = int(counters["step"])
        done["step"] = framework.step
    return done


# -- the c10d flight recorder ------------------------------------------------------------------------------------
_ENV = "TORCH_FR_BUFFER_SIZE"


def enable() -> bool:
    """Turn the recorder on (PROBE_COLLECTIVES entries) unless the user set its buffer size; whether it did."""
    size = setting("PROBE_COLLECTIVES")
    if _ENV in os.environ or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or size <= 0:
        return False
    if not _group_exists():  # torch reads the variable when the first group is made: later is too late
        os.environ[_ENV] = str(size)
        return True
    msg = "the process group existed before the probe started; import probe.auto before init_process_group"
    record_error(
        "torch.collectives", RuntimeError(f"the flight recorder is off: {msg}, run with PROBE=1, or set {_ENV}")
    )
    return False


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
    fn = getattr(sys.modules.get("torch._C._distributed_c10d"), "_dump_fr_trace", None)
    if fn is None or not _group_exists():
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
    backend, sep, op = (profiling_name or "").partition(":")
    return (backend, op) if sep else (None, backend or None)


def _ns(v) -> float | None:
    return v / 1e9 if v else None


_PROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # probe/ (this file is in probe/training)


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    return os.path.dirname(os.path.abspath(torch.__file__)) if torch is not None else None


def _frame_text(f: dict) -> str:
    return f"{f.get('name')} ({os.path.basename(str(f.get('filename')))}:{f.get('line')})"


# probe's wrappers that a user's call passes through on its way to torch (its backward, GradScaler.scale,
# clip_grad_norm_, a probe.span, the root model's call clock): a collective below them is the user's
_PASS_THROUGH = {
    ("hooks.py", "clocked"),
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
    tdir = _torch_dir()
    rows = []
    for e in (doc or {}).get("entries") or []:
        backend, op = split_op(e.get("profiling_name"))
        pg = e.get("process_group") or ("", "")
        started, completed = _ns(e.get("time_discovered_started_ns")), _ns(e.get("time_discovered_completed_ns"))
        duration = e.get("duration_ms")
        duration = duration / 1000.0 if duration is not None else completed - started if started and completed else None
        frames = e.get("frames") or []
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
                "call_site": call_site(frames, tdir),
                "frames": "; ".join(_frame_text(f) for f in frames) if frames else None,
            }
        )
    return rows


def _text(v) -> str | None:
    return None if v is None else str(v).replace("'", "")


def group_rows(doc: dict | None) -> list[dict]:
    """One row per process group: its ranks and its last enqueued, started and completed sequence ids.

    >>> group_rows(None), entry_rows(None)  # no recorder (no process group): no rows
    ([], [])
    """
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
    """Per step: (compute, comm_wait) seconds, split at its last collective's creation (``created``: sorted epoch
    seconds). In a synchronous step this rank's own work issues every collective: after the last one it waits for
    the others (and steps its optimizer). Steps without a recorded collective get NaN.

    >>> step_split([0.0, 1.0], [1.0, 2.5], [0.2, 0.7, 1.4, 2.0])
    ([0.7, 1.0], [0.30000000000000004, 0.5])
    """
    compute, wait = [], []
    for s, e in zip(started, ended):
        i = bisect.bisect_left(created, e) - 1
        last = created[i] if i >= 0 and created[i] >= s else float("nan")
        compute.append(last - s)
        wait.append(e - last)
    return compute, wait
