"""The one object finder: models, optimizers, schedulers, grad scalers and DataLoaders of the training loop.

Every part of the probe that needs a training object (the torch tables, the step
tracker, the tracer, the lr, checkpoint and eval actions) asks here, and gets
``Found`` records: ``(name, obj, wrapper, source)``.

Objects are found, in order of precedence of their names:

* ``probe.watch(...)`` names them explicitly;
* the optimizer step hook reports each optimizer that steps;
* ``__main__``'s globals (``model``, ``optimizer``, ...), read whenever an answer is asked for;
* the framework objects on the training thread's stack, looked for at the step boundary
  (steps 1, 2, 4, 8, ...): a Lightning ``Trainer`` (``lightning_module``, ``optimizers``,
  ``lr_scheduler_configs``), a transformers ``Trainer`` (``model``, ``optimizer``,
  ``lr_scheduler``) and an accelerate ``Accelerator`` (its prepared models, optimizers and
  schedulers), found as a local (or ``self``) of any frame, or as a ``LightningModule``'s trainer;
* the locals of the training loop's frames and the attributes of ``self``-like objects there.

DataLoaders (``torch.utils.data.DataLoader`` and its subclasses, and the iterators ``iter(loader)``
returns) are found the same way, with no look of their own: as globals, loop locals and attributes
there, and as the frameworks' loaders (Lightning's ``train_dataloader``, the transformers Trainer's
``callback_handler.train_dataloader``, accelerate's prepared ``_dataloaders``).

Framework wrappers are unwrapped to the object that owns the state: an optimizer wrapper
(accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, DeepSpeed's ZeRO
optimizers) whose ``param_groups`` is its inner optimizer's list is replaced by that inner
optimizer, and ``Found.wrapper`` names the wrapper's class; accelerate's
``AcceleratedScheduler`` is replaced by the scheduler it drives. So each real param group
is seen once.

References are weak, so an object the training script drops is dropped here too. Nothing
here imports torch or a framework: types are recognised by their module and class name,
and only once their module is imported. A failure while looking is recorded in
``probe.errors``; what was found before it stays found.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any, NamedTuple

from ..util.errorlog import record_error

__all__ = ["Found", "known", "is_internal", "models", "optimizers", "schedulers", "grad_scalers", "frameworks", "dataloaders",
           "scheduler_for",
           "optimizer_found", "unwrap_optimizer", "add", "scan",
           "user_frame", "named", "objects_of", "framework_of", "main_globals", "module_path", "FRAMEWORK_PACKAGES"]

KINDS = ("model", "optimizer", "scheduler", "scaler", "framework", "dataloader")
# Packages whose frames are the framework's, not the user's loop (for the user's frame and eval).
FRAMEWORK_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "transformers",
                      "accelerate", "deepspeed", "trl", "peft", "torchmetrics")
_PRECEDENCE = {"watch": 0, "__main__": 1, "framework": 2, "frame": 3, "step hook": 4}  # for names
_FRAMEWORK_TYPES = {
    ("lightning.pytorch.trainer.trainer", "Trainer"): "lightning",
    ("pytorch_lightning.trainer.trainer", "Trainer"): "lightning",
    ("transformers.trainer", "Trainer"): "transformers",
    ("accelerate.accelerator", "Accelerator"): "accelerate",
}
_LIGHTNING_MODULES = {("lightning.pytorch.core.module", "LightningModule"),
                      ("pytorch_lightning.core.module", "LightningModule")}


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
        self.ref, self.name, self.wrapper, self.source, self.framework = weakref.ref(obj), name, wrapper, source, framework


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


# -- recognising types without importing them -------------------------------------------------------
def framework_of(obj) -> str | None:
    try:
        mro = type(obj).__mro__
    except Exception:
        return None
    for cls in mro:
        kind = _FRAMEWORK_TYPES.get((cls.__module__, cls.__name__))
        if kind is not None:
            return kind
    return None


def _is_lightning_module(obj) -> bool:
    return any((c.__module__, c.__name__) in _LIGHTNING_MODULES for c in type(obj).__mro__)


def _scheduler_types(torch) -> tuple:
    lrs = torch.optim.lr_scheduler
    return tuple(c for c in (getattr(lrs, "LRScheduler", None), getattr(lrs, "ReduceLROnPlateau", None)) if c)


def _scaler_types(torch) -> tuple:
    return tuple(t for t in (getattr(getattr(torch, "amp", None), "GradScaler", None),
                             getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)) if isinstance(t, type))


def unwrap_optimizer(opt) -> tuple[Any, str | None]:
    """``(inner, wrapper class name)``: the optimizer that owns ``opt``'s param_groups.

    A wrapper is recognised by what it does, not by its name: it keeps the inner optimizer
    as ``optimizer`` or ``_optimizer`` and its ``param_groups`` is the inner one's list.
    """
    wrapper = None
    for _ in range(4):  # wrappers of wrappers (DeepSpeed inside accelerate)
        try:
            attrs = vars(opt)
        except TypeError:
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


def _unwrap_scheduler(torch, sched):
    kinds = _scheduler_types(torch)
    for _ in range(3):
        if isinstance(sched, kinds):
            return sched
        inner = vars(sched).get("scheduler") if hasattr(sched, "__dict__") else None
        if inner is None:
            return None
        sched = inner
    return sched if isinstance(sched, kinds) else None


# -- the registry ---------------------------------------------------------------------------------------
def _kind_of(torch, obj) -> str | None:
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, _scheduler_types(torch)) or (_unwrap_scheduler(torch, obj) is not None
                                                    and type(obj).__name__ == "AcceleratedScheduler"):
        return "scheduler"
    kinds = _scaler_types(torch)
    if kinds and isinstance(obj, kinds):
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
    kinds = tuple(t for t in (getattr(data, "DataLoader", None), getattr(data, "_BaseDataLoaderIter", None))
                  if isinstance(t, type))
    return bool(kinds) and isinstance(obj, kinds)


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
        inner = _unwrap_scheduler(torch, obj)
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
    for f in (_refreshed("framework") if refresh else _live("framework")):
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
        if name.startswith("__") or isinstance(value, type):
            continue
        kind = _kind_of(torch, value)
        if kind is not None:
            add(value, name, "__main__", kind)


def _scan_frameworks() -> None:
    for f in _live("framework"):
        _from_framework(f.obj, f.name)


def _framework_items(obj, name: str):
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
        for attr, k in (("model", "model"), ("optimizer", "optimizer"), ("lr_scheduler", "scheduler"),
                        ("accelerator", "framework")):
            yield getattr(obj, attr, None), f"{name}.{attr}", k
        handler = getattr(obj, "callback_handler", None)  # the training loop's loader is set there for callbacks
        yield getattr(handler, "train_dataloader", None), f"{name}.callback_handler.train_dataloader", "dataloader"
    elif kind == "accelerate":
        for attr, k in (("_models", "model"), ("_optimizers", "optimizer"), ("_schedulers", "scheduler"),
                        ("_dataloaders", "dataloader")):
            for i, value in enumerate(list(getattr(obj, attr, None) or [])):
                yield value, f"{name}.{attr}[{i}]", k


def _lightning_train_loaders(trainer):
    """The fit loop's loaders as the user returned them, without asking the LightningModule for new ones
    (``Trainer.train_dataloader`` reads the fit loop's combined loader; None before fit starts)."""
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
    torch = _torch()
    for value, _, kind in _framework_items(framework, "trainer"):
        if value is None or kind in out or kind in ("framework", "dataloader"):
            continue
        if kind == "optimizer":
            value = unwrap_optimizer(value)[0]
        elif kind == "scheduler" and torch is not None:
            value = _unwrap_scheduler(torch, value)
        out[kind] = value
    return out


def _from_framework(obj, name: str) -> None:
    """Remember the objects a framework object holds (Lightning's optimizer wrappers give their class)."""
    kind = framework_of(obj)
    try:
        for value, vname, k in _framework_items(obj, name):
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
        elif kind == "model" and _is_lightning_module(obj):
            trainer = vars(obj).get("_trainer")
            if trainer is not None and id(trainer) not in seen:
                seen.add(id(trainer))
                add(trainer, "trainer", "framework", "framework")
                _from_framework(trainer, "trainer")
        return
    if depth == 0 and hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__ != "builtins":
        try:
            attrs = list(vars(obj).items())
        except TypeError:
            return
        for attr, value in attrs[:200]:
            _classify(torch, value, attr, seen, depth + 1, source)


def _framework_name(value, name: str) -> str:
    """A framework object seen as ``self`` is named for what it is (trainer, accelerator)."""
    if name != "self":
        return name
    kind = framework_of(value)
    return "accelerator" if kind == "accelerate" else "trainer" if kind else name


def scan(frame=None, max_frames: int = 4) -> None:
    """Look near ``frame`` (its locals and ``self``'s attributes, ``max_frames`` frames out), for framework
    objects on the calling thread's whole stack (a Trainer's frames hold it as ``self``), and in ``__main__``."""
    torch = _torch()
    if torch is None:
        return
    from ..util.frames import release

    seen: set = set()
    near, n = set(), 0
    f = frame
    while f is not None and n < max_frames:
        near.add(id(f))
        loc = f.f_locals
        try:
            for name, value in list(loc.items()):
                _classify(torch, value, _framework_name(value, name), seen, 0, "frame")
        finally:
            release(f, loc)  # 3.11/3.12: the snapshot would keep these objects alive until the next read
        f, n = f.f_back, n + 1
    f = sys._getframe(1)
    while f is not None:
        if id(f) not in near and f.f_code.co_filename != __file__:
            loc = f.f_locals
            try:
                for name, value in list(loc.items()):
                    if id(value) not in seen and (framework_of(value) is not None or (
                            isinstance(value, torch.nn.Module) and _is_lightning_module(value))):
                        _classify(torch, value, _framework_name(value, name), seen, 1, "frame")
            finally:
                release(f, loc, own=True)
        f = f.f_back
    _scan_main()


# -- frames -------------------------------------------------------------------------------------------------

_PROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # probe/ (this file is in probe/training)
_internal: dict = {}  # co_filename -> inside torch, probe, a training framework, or stdlib plumbing


def _package_dirs() -> tuple:
    dirs = [_PROBE_DIR]
    for pkg in ("torch",) + FRAMEWORK_PACKAGES:
        mod = sys.modules.get(pkg)
        path = getattr(mod, "__file__", None) if mod is not None else None
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)))
    return tuple(d + os.sep for d in dirs)


def is_internal(code) -> bool:
    """Whether ``code`` belongs to torch, probe, a training framework or contextlib/threading (cached per file)."""
    f = code.co_filename
    hit = _internal.get(f)
    if hit is None:
        if f.startswith("<"):
            hit = f.startswith("<frozen")
        else:
            p = os.path.abspath(f)
            hit = p.startswith(_package_dirs()) or os.path.basename(p) in ("contextlib.py", "threading.py")
        _internal[f] = hit
    return hit


def user_frame(frame):
    """The nearest frame from ``frame`` outwards that is the user's code (see ``is_internal``)."""
    while frame is not None and is_internal(frame.f_code):
        frame = frame.f_back
    return frame


def named() -> dict:
    """Found objects under their names and the usual ones (for eval): model, optimizer, scheduler, scaler, trainer, accelerator."""
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
