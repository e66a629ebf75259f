"""What the training loop is made of: models, optimizers, schedulers, grad scalers.

Nothing here imports torch. Objects are found three ways, in order of precedence:
``probe.watch(...)`` names them explicitly; the optimizer step hook reports each
optimizer that steps; and a scan of the training loop's frames (its locals, the
attributes of ``self``-like objects there, and ``__main__``'s globals) finds the
models, schedulers and scalers next to it. References are weak, so a model that
the training script drops is dropped here too; only the last training-loop frame
is held strongly (it is alive anyway while the loop runs).
"""

from __future__ import annotations

import sys
import threading
import weakref

from ..util.frames import release

__all__ = ["models", "optimizers", "scheduler_for", "schedulers", "grad_scalers", "training_frame", "module_path",
           "add_model", "add_optimizer", "add_scheduler", "add_grad_scaler", "set_training_frame", "scan"]

_lock = threading.Lock()
_models: dict[int, tuple[weakref.ref, str]] = {}  # id -> (ref, name); insertion order = discovery order
_optimizers: dict[int, weakref.ref] = {}
_schedulers: dict[int, weakref.ref] = {}
_scalers: dict[int, weakref.ref] = {}
_frame = None


def _torch():
    return sys.modules.get("torch")


def _live(registry: dict) -> list:
    out = []
    with _lock:
        for key, ref in list(registry.items()):
            obj = ref() if not isinstance(ref, tuple) else ref[0]()
            if obj is None:
                del registry[key]
            else:
                out.append(obj)
    return out


def _add(registry: dict, obj, value=None) -> None:
    key = id(obj)
    with _lock:
        current = registry.get(key)
        if current is not None and (current[0] if isinstance(current, tuple) else current)() is obj:
            return
        registry[key] = value if value is not None else weakref.ref(obj)


def add_model(model, name: str | None = None) -> None:
    """Remember ``model`` as a root model (a submodule of a known root is ignored)."""
    with _lock:
        known = [(r(), n) for r, n in _models.values()]
    for other, other_name in known:
        if other is model:
            if name and name != other_name:
                with _lock:
                    _models[id(model)] = (weakref.ref(model), name)
            return
        if other is not None and any(m is model for m in other.modules()):
            return
    # A new root that contains known roots replaces them.
    contained = {id(m) for m in model.modules()}
    with _lock:
        for key in [k for k, (r, _) in _models.items() if k in contained and r() is not None]:
            del _models[key]
        _models[id(model)] = (weakref.ref(model), name or type(model).__name__)


def add_optimizer(opt) -> None:
    _add(_optimizers, opt)


def add_scheduler(sched) -> None:
    _add(_schedulers, sched)


def add_grad_scaler(scaler) -> None:
    _add(_scalers, scaler)


def module_path(name: str) -> str:
    """A submodule's dotted path as the user wrote the model: torch.compile's wrapper adds
    an ``_orig_mod`` level (``_orig_mod.blocks.3``), which is dropped (``blocks.3``)."""
    if "_orig_mod" not in name:
        return name
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


def set_training_frame(frame) -> None:
    global _frame
    _frame = frame


def models() -> list[tuple[str, object]]:
    """Root models as ``(name, module)``, in the order they were found."""
    if _torch() is None:
        return []
    out = []
    with _lock:
        for key, (ref, name) in list(_models.items()):
            m = ref()
            if m is None:
                del _models[key]
            else:
                out.append((name, m))
    return out


def optimizers() -> list:
    return _live(_optimizers) if _torch() is not None else []


def schedulers() -> list:
    return _live(_schedulers) if _torch() is not None else []


def grad_scalers() -> list:
    return _live(_scalers) if _torch() is not None else []


def scheduler_for(optimizer):
    """The LR scheduler driving ``optimizer``, or None."""
    for sched in schedulers():
        if getattr(sched, "optimizer", None) is optimizer:
            return sched
    return None


def training_frame():
    """The last frame seen running the training loop (where ``optimizer.step()`` was called), or None."""
    return _frame


def _classify(torch, obj, name: str, seen: set, depth: int) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        if any(True for _ in obj.parameters()):
            add_model(obj, name)
    elif isinstance(obj, torch.optim.Optimizer):
        add_optimizer(obj)
    elif _is_scheduler(torch, obj):
        add_scheduler(obj)
    elif _is_scaler(torch, obj):
        add_grad_scaler(obj)
    elif depth == 0 and hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__ != "builtins":
        try:
            attrs = list(vars(obj).items())
        except TypeError:
            return
        for attr, value in attrs[:200]:
            _classify(torch, value, attr, seen, depth + 1)


def _is_scheduler(torch, obj) -> bool:
    lrs = torch.optim.lr_scheduler
    bases = tuple(c for c in (getattr(lrs, "LRScheduler", None), getattr(lrs, "ReduceLROnPlateau", None)) if c)
    return isinstance(obj, bases)


def _is_scaler(torch, obj) -> bool:
    amp = getattr(torch, "amp", None)
    cls = getattr(amp, "GradScaler", None) if amp is not None else None
    return cls is not None and isinstance(obj, cls)


def scan(frame=None, max_frames: int = 4) -> None:
    """Look for models, optimizers, schedulers and scalers near ``frame`` and in ``__main__``."""
    torch = _torch()
    if torch is None:
        return
    seen: set = set()
    f, n = frame, 0

    while f is not None and n < max_frames:
        loc = f.f_locals
        for name, value in list(loc.items()):
            _classify(torch, value, name, seen, 0)
        release(f, loc)  # 3.11/3.12: the snapshot would keep these objects alive until the next read
        f, n = f.f_back, n + 1
    main = sys.modules.get("__main__")
    if main is not None:
        for name, value in list(vars(main).items()):
            if not name.startswith("__"):
                _classify(torch, value, name, seen, 1)  # globals: no attribute walk (modules, classes)
