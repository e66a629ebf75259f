"""The one object finder: models, optimizers, schedulers, grad scalers, DataLoaders and framework objects.

Every part of the probe that needs a training object asks here and gets ``Found`` records
``(name, obj, wrapper, source)``. Objects are found, in order of precedence of their names: named by
``probe.watch(...)``; reported by the optimizer step hook; ``__main__``'s globals (read whenever an answer is
asked for); the framework objects on the training thread's stack, looked for at the step boundary (steps 1, 2,
4, 8, ...): a Lightning or transformers ``Trainer`` or an accelerate ``Accelerator`` (a local or ``self`` of any
frame, or a ``LightningModule``'s trainer) and the objects each holds (``frameworks.framework_items``); the
locals of the training loop's frames and the attributes of ``self``-like objects there. DataLoaders and their
iterators are found the same way, with no look of their own.

A framework's wrapper is unwrapped to the object that owns the state (an optimizer wrapper whose
``param_groups`` is its inner optimizer's list, accelerate's ``AcceleratedScheduler``), and ``Found.wrapper``
names the wrapper's class, so each real param group is seen once. References are weak: an object the script
drops is dropped here too. Nothing here imports torch or a framework (types are recognised by module and class
name); a failure while looking is recorded in ``probe.errors`` and what was found before it stays found.
"""

from __future__ import annotations

import sys
import threading
import weakref
from itertools import islice
from typing import Any, NamedTuple

from .._errors import ActionError
from ..util.errorlog import record_error
from ..util.objects import instance_dict, is_a
from .frameworks import (
    framework_items,
    framework_name,
    framework_of,
    is_lightning_module,
    scaler_types,
    scheduler_types,
    unwrap_optimizer,
    unwrap_scheduler,
)

KINDS = ("model", "optimizer", "scheduler", "scaler", "framework", "dataloader")
_PRECEDENCE = {"watch": 0, "__main__": 1, "framework": 2, "frame": 3, "step hook": 4}  # for names


class Found(NamedTuple):
    """One training object: the name the user knows it by, the object that owns the state,
    the framework wrapper's class name it was reached through (or None), and where it was found."""

    name: str
    obj: Any
    wrapper: str | None = None
    source: str = "frame"


class _Entry:
    __slots__ = ("ref", "name", "wrapper", "source", "framework")

    def __init__(self, obj, name, wrapper, source, framework=None):
        self.ref, self.name, self.wrapper = weakref.ref(obj), name, wrapper
        self.source, self.framework = source, framework


_lock = threading.RLock()
_found: dict[str, dict[int, _Entry]] = {k: {} for k in KINDS}  # insertion order = discovery order


def _torch():
    return sys.modules.get("torch")


def main_globals() -> dict:
    main = sys.modules.get("__main__")
    return dict(vars(main)) if main is not None else {}


def module_path(name: str) -> str:
    """A submodule's dotted path as the user wrote the model: torch.compile's wrapper adds
    an ``_orig_mod`` level (``_orig_mod.blocks.3``), which is dropped (``blocks.3``)."""
    if "_orig_mod" not in name:
        return name
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


# -- the registry ---------------------------------------------------------------------------------------
def _kind_of(torch, obj) -> str | None:
    if is_a(obj, torch.nn.Module):
        return "model"
    if is_a(obj, torch.optim.Optimizer):
        return "optimizer"
    if is_a(obj, scheduler_types(torch)) or (
        type(obj).__name__ == "AcceleratedScheduler" and unwrap_scheduler(torch, obj) is not None
    ):
        return "scheduler"
    kinds = scaler_types(torch)
    if kinds and is_a(obj, kinds):
        return "scaler"
    if framework_of(obj) is not None:
        return "framework"
    if _is_dataloader(obj):
        return "dataloader"
    return None


def _is_dataloader(obj) -> bool:
    """A DataLoader, or the iterator one returns (``iter(loader)``), once torch.utils.data is imported."""
    data = sys.modules.get("torch.utils.data.dataloader")
    if data is None:
        return False
    kinds = tuple(
        t
        for t in (getattr(data, "DataLoader", None), getattr(data, "_BaseDataLoaderIter", None))
        if isinstance(t, type)
    )
    return bool(kinds) and is_a(obj, kinds)


def add(obj, name: str | None = None, source: str = "frame", kind: str | None = None) -> Found | None:
    """Remember ``obj`` (unwrapped); a better-sourced name replaces a worse one. Returns its record."""
    torch = _torch()
    if torch is None or obj is None:
        return None
    kind = kind or _kind_of(torch, obj)
    if kind is None:
        return None
    wrapper = framework = None
    if kind == "optimizer":
        obj, wrapper = unwrap_optimizer(obj)
    elif kind == "scheduler":
        inner = unwrap_scheduler(torch, obj)
        if inner is None:
            return None
        if inner is not obj:
            wrapper, obj = type(obj).__name__, inner
    elif kind == "framework":
        framework = framework_of(obj)
    elif kind == "model":
        if not _add_model(obj, name, source):
            return None
        return _record("model", obj)
    elif kind == "dataloader" and not _is_dataloader(obj):  # a framework's attribute that held something else
        return None
    name = name or type(obj).__name__.lower()
    with _lock:
        reg = _found[kind]
        e = reg.get(id(obj))
        if e is None or e.ref() is not obj:
            reg[id(obj)] = _Entry(obj, name, wrapper, source, framework)
        else:
            if _PRECEDENCE.get(source, 9) < _PRECEDENCE.get(e.source, 9):
                e.name, e.source = name, source
            e.wrapper = e.wrapper or wrapper
    return _record(kind, obj)


def _add_model(model, name, source) -> bool:
    """Root models only: a submodule of a known root is left out; a new root replaces the roots it contains."""
    try:
        if not any(True for _ in model.parameters()):
            return False
        with _lock:
            reg = _found["model"]
            e = reg.get(id(model))
            if e is not None and e.ref() is model:
                if name and _PRECEDENCE.get(source, 9) < _PRECEDENCE.get(e.source, 9):
                    e.name, e.source = name, source
                return True
            known = [en.ref() for en in reg.values()]
        for other in known:
            if other is not None and any(m is model for m in other.modules()):
                return False
        contained = {id(m) for m in model.modules()}
        with _lock:
            reg = _found["model"]
            for key in [k for k, en in reg.items() if k in contained and en.ref() is not None]:
                del reg[key]
            reg[id(model)] = _Entry(model, name or type(model).__name__, None, source)
        return True
    except Exception as exc:
        record_error("finding models", exc)
        return False


def _record(kind: str, obj) -> Found | None:
    with _lock:
        e = _found[kind].get(id(obj))
        return Found(e.name, obj, e.wrapper, e.source) if e is not None and e.ref() is obj else None


def known(kind: str) -> list[Found]:
    """What was found so far of ``kind`` (model, optimizer, scheduler, scaler, framework), without looking again."""
    return _live(kind)


def _live(kind: str) -> list[Found]:
    out = []
    with _lock:
        reg = _found[kind]
        for key, e in list(reg.items()):
            obj = e.ref()
            if obj is None:
                del reg[key]
            else:
                out.append(Found(e.name, obj, e.wrapper, e.source))
    return out


def _refreshed(kind: str) -> list[Found]:
    """The objects of ``kind``, after a look at __main__'s globals and the known frameworks' objects."""
    if _torch() is None:
        return []
    try:
        _scan_main()
        _scan_frameworks()
    except Exception as exc:
        record_error("finding training objects", exc)
    return _live(kind)


def models() -> list[Found]:
    return _refreshed("model")


def optimizers() -> list[Found]:
    return _refreshed("optimizer")


def optimizers_to_act_on() -> list[Found]:
    """The optimizers found, for an action that needs one: ActionError with a sentence when there is none."""
    found = optimizers()
    if not found:
        raise ActionError(
            "no optimizer found in the training process; it is found once it has stepped, as a global of the "
            "training script, or through a Lightning/HF Trainer or an Accelerator."
        )
    return found


def schedulers() -> list[Found]:
    return _refreshed("scheduler")


def grad_scalers() -> list[Found]:
    return _refreshed("scaler")


def dataloaders() -> list[Found]:
    """DataLoaders and DataLoader iterators found (the iterator a persistent-workers loader keeps is left
    out: its loader's row stands for it)."""
    found = _refreshed("dataloader")
    loaders = [f.obj for f in found if hasattr(f.obj, "dataset")]  # iterators keep ``_dataset`` only
    return [f for f in found if not any(_iterates(f.obj, loader) for loader in loaders)]


def _iterates(it, loader) -> bool:
    """Whether ``it`` is an iterator of the DataLoader ``loader``: its persistent one, or one that ``iter(loader)``
    returned (it keeps the loader's dataset and index sampler, never the loader itself)."""
    if it is loader:
        return False
    if getattr(loader, "_iterator", None) is it:
        return True
    try:
        return it._dataset is loader.dataset and it._index_sampler is loader._index_sampler
    except Exception:
        return False


def frameworks(refresh: bool = True) -> list[Found]:
    """Framework objects found (a Lightning or transformers Trainer, an Accelerator); ``wrapper`` holds
    the framework's name (lightning, transformers, accelerate). ``refresh=False``: those found already,
    without a new look (for a frequent caller such as the status)."""
    out = []
    for f in _refreshed("framework") if refresh else _live("framework"):
        e = _found["framework"].get(id(f.obj))
        out.append(f._replace(wrapper=e.framework if e is not None else None))
    return out


def optimizer_found(opt) -> Found | None:
    """The record of one optimizer (after unwrapping), without rescanning: for the hot path."""
    inner, _ = unwrap_optimizer(opt)
    return _record("optimizer", inner)


def scheduler_for(optimizer) -> list[Found]:
    """Every found scheduler driving ``optimizer`` (usually one), compared after unwrapping both."""
    inner, _ = unwrap_optimizer(optimizer)
    out = []
    for f in schedulers():
        o = getattr(f.obj, "optimizer", None)
        if o is not None and unwrap_optimizer(o)[0] is inner:
            out.append(f)
    return out


# -- looking ----------------------------------------------------------------------------------------------
def _scan_main() -> None:
    torch = _torch()
    for name, value in main_globals().items():
        if name.startswith("__") or is_a(value, type):
            continue
        kind = _kind_of(torch, value)
        if kind is not None:
            add(value, name, "__main__", kind)


def _scan_frameworks() -> None:
    for f in _live("framework"):
        _from_framework(f.obj, f.name)


def _from_framework(obj, name: str) -> None:
    """Remember the objects a framework object holds (Lightning's optimizer wrappers give their class)."""
    kind = framework_of(obj)
    try:
        for value, vname, k in framework_items(obj, name):
            if value is None:
                continue
            add(value, vname, "framework", k)
            if k == "framework":
                _from_framework(value, vname)
        if kind == "lightning":
            for w in getattr(getattr(obj, "strategy", None), "_lightning_optimizers", None) or []:
                inner = unwrap_optimizer(w)[0]
                with _lock:
                    e = _found["optimizer"].get(id(inner))
                    if e is not None and e.wrapper is None and inner is not w:
                        e.wrapper = type(w).__name__
    except Exception as exc:
        record_error(f"finding the objects of {type(obj).__name__} ({kind})", exc)


def _classify(torch, obj, name: str, seen: set, depth: int, source: str) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    kind = _kind_of(torch, obj)
    if kind is not None:
        add(obj, name, source, kind)
        if kind == "framework":
            _from_framework(obj, name)
        elif kind == "model" and is_lightning_module(obj):
            trainer = (instance_dict(obj) or {}).get("_trainer")
            if trainer is not None and id(trainer) not in seen:
                seen.add(id(trainer))
                add(trainer, "trainer", "framework", "framework")
                _from_framework(trainer, "trainer")
        return
    if depth == 0 and not is_a(obj, type) and type(obj).__module__ != "builtins":
        attrs = instance_dict(obj)
        if attrs is None:
            return
        for attr, value in list(islice(attrs.items(), 200)):
            _classify(torch, value, attr, seen, depth + 1, source)


def scan(frame=None, max_frames: int = 4) -> None:
    """Look near ``frame`` (its locals and ``self``'s attributes, ``max_frames`` frames out), for framework
    objects on the calling thread's whole stack (a Trainer's frames hold it as ``self``), and in ``__main__``."""
    torch = _torch()
    if torch is None:
        return
    from ..util.usercode import release

    seen: set = set()
    near, n = set(), 0
    f = frame
    while f is not None and n < max_frames:
        near.add(id(f))
        loc = f.f_locals
        try:
            for name, value in list(loc.items()):
                _classify(torch, value, framework_name(value, name), seen, 0, "frame")
        finally:
            release(f, loc)  # 3.11/3.12: the snapshot would keep these objects alive until the next read
        f, n = f.f_back, n + 1
    f = sys._getframe(1)
    while f is not None:
        if id(f) not in near and f.f_code.co_filename != __file__:
            loc = f.f_locals
            try:
                for name, value in list(loc.items()):
                    if id(value) not in seen and (
                        framework_of(value) is not None or (is_a(value, torch.nn.Module) and is_lightning_module(value))
                    ):
                        _classify(torch, value, framework_name(value, name), seen, 1, "frame")
            finally:
                release(f, loc, own=True)
        f = f.f_back
    _scan_main()


def named() -> dict:
    """Found objects under their names and the usual ones (for eval): model, optimizer, scheduler, scaler, trainer,
    accelerator."""
    out = {}
    groups = (("model", models()), ("optimizer", optimizers()), ("scheduler", schedulers()), ("scaler", grad_scalers()))
    for key, found in groups:
        for f in found:
            if f.name.isidentifier():
                out.setdefault(f.name, f.obj)
        if found:
            out.setdefault(key, found[0].obj)
    for f in frameworks():
        if f.name.isidentifier():
            out.setdefault(f.name, f.obj)
        out.setdefault("accelerator" if f.wrapper == "accelerate" else "trainer", f.obj)
    return out


# -- the frameworks' step counters ----------------------------------------------------------------
def framework_counters(in_step: bool = False, refresh: bool = True) -> dict:
    """The step counters of the framework objects found: ``{name: {"global_step": n, ...}}`` for a
    Trainer, ``{name: {"step": n}}`` for an Accelerator that is not a transformers Trainer's own.

    ``in_step``: read inside an optimizer step (probe's safe point), where both Trainers have
    not yet counted the step that is finishing; it is counted here, so the numbers match the
    weights, which already have it. An Accelerator's ``step`` counts micro-batches when
    ``accumulate`` is entered, before the optimizer step: it is taken as it is.
    """
    out = {}
    extra = 1 if in_step else 0
    found = frameworks(refresh)
    # transformers' Trainer drives its Accelerator's counters itself (it never uses accelerator.step)
    held = {id(getattr(f.obj, "accelerator", None)) for f in found if f.wrapper == "transformers"}
    for f in found:
        try:
            if f.wrapper == "lightning":
                out[f.name] = {"global_step": int(f.obj.global_step) + extra, "current_epoch": int(f.obj.current_epoch)}
            elif f.wrapper == "transformers":
                st = f.obj.state
                out[f.name] = {"global_step": int(st.global_step) + extra, "epoch": float(st.epoch or 0.0)}
            elif f.wrapper == "accelerate" and id(f.obj) not in held and isinstance(getattr(f.obj, "step", None), int):
                out[f.name] = {"step": int(f.obj.step)}
        except Exception as exc:
            record_error(f"reading {f.name}'s step counters", exc)
    return out


def framework_status() -> dict:
    """The framework's own step beside probe's (a status provider): ``framework_step`` and where it comes
    from (``framework_counter``, e.g. ``trainer.global_step``), from the first Trainer or Accelerator
    found; nothing without one. probe counts the optimizer steps it saw, from 1 when it started: after
    ``probe inject`` into a run at step 5000 the two differ, and the framework's is the run's."""
    for name, counters in framework_counters(refresh=False).items():
        for key in ("global_step", "step"):
            if key in counters:
                return {"framework_step": counters[key], "framework_counter": f"{name}.{key}"}
    return {}
