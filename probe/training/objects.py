"""Find the training objects an action works on: models, optimizers, schedulers, scalers.

The torch observability room's ``probe._discovery`` is asked first; whatever it does
not know is found by scanning the ``__main__`` module's globals (``model``,
``optimizer``, ...), which is also how eval resolves names. Nothing here imports
torch unless the training process already has.
"""

from __future__ import annotations

import os
import sys

from . import finder
from typing import Any

__all__ = ["main_globals", "models", "optimizers", "schedulers", "scheduler_for", "grad_scalers", "training_frame", "named"]


def main_globals() -> dict:
    main = sys.modules.get("__main__")
    return dict(vars(main)) if main is not None else {}


def _discovery(name: str):
    fn = getattr(finder, name, None)
    if fn is None:
        return None
    try:
        return list(fn())
    except Exception:
        return None


def _torch():
    return sys.modules.get("torch")


def _scan(kind) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in main_globals().items() if not k.startswith("__") and isinstance(v, kind)]


def _merge(found: list | None, scanned: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Discovered objects keep their global name when they have one; no duplicates."""
    names = {id(v): k for k, v in scanned}
    out, seen = [], set()
    for item in list(found or []) + list(scanned):
        given, obj = item if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else (None, item)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        out.append((names.get(id(obj)) or given or f"{type(obj).__name__.lower()}{len(out)}", obj))
    return out


def models() -> list[tuple[str, Any]]:
    """Top-level modules: a module that is a child of another found module is left out."""
    torch = _torch()
    if torch is None:
        return []
    found = _merge(_discovery("models"), _scan(torch.nn.Module))
    children = set()
    for _, m in found:
        for sub in m.modules():
            if sub is not m:
                children.add(id(sub))
    return [(k, m) for k, m in found if id(m) not in children]


def optimizers() -> list[tuple[str, Any]]:
    torch = _torch()
    if torch is None:
        return []
    return _merge(_discovery("optimizers"), _scan(torch.optim.Optimizer))


def _scheduler_types() -> tuple:
    torch = _torch()
    sched = torch.optim.lr_scheduler
    return tuple(t for t in (getattr(sched, "LRScheduler", None), getattr(sched, "_LRScheduler", None),
                             getattr(sched, "ReduceLROnPlateau", None)) if t is not None)


def schedulers() -> list[tuple[str, Any]]:
    if _torch() is None:
        return []
    return _merge(_discovery("schedulers"), _scan(_scheduler_types()))


def scheduler_for(optimizer) -> list[tuple[str, Any]]:
    """Every found scheduler driving ``optimizer`` (usually one)."""
    return [(k, s) for k, s in schedulers() if getattr(s, "optimizer", None) is optimizer]


def grad_scalers() -> list[tuple[str, Any]]:
    torch = _torch()
    if torch is None:
        return []
    kinds = tuple(t for t in (getattr(getattr(torch, "amp", None), "GradScaler", None),
                              getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)) if isinstance(t, type))
    return _merge(_discovery("grad_scalers"), _scan(kinds) if kinds else [])


_SKIP = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)  # probe/ (this file is in probe/training)


def training_frame(start=None):
    """The innermost frame of user code on this thread's stack (outside torch, probe, stdlib threading)."""
    torch = _torch()
    skip = _SKIP + ((os.path.dirname(os.path.abspath(torch.__file__)),) if torch is not None else ())
    frame = start or sys._getframe(1)
    while frame is not None:
        file = os.path.abspath(frame.f_code.co_filename)
        if not file.startswith(skip) and not frame.f_code.co_filename.startswith("<") \
                and os.path.basename(file) not in ("threading.py", "contextlib.py"):
            return frame
        frame = frame.f_back
    return None


def named() -> dict:
    """Discovered objects under their usual names (for eval): model, optimizer, scheduler, scaler."""
    out = {}
    for key, found in (("model", models()), ("optimizer", optimizers()), ("scheduler", schedulers()),
                       ("scaler", grad_scalers())):
        for name, obj in found:
            out.setdefault(name, obj)
        if found:
            out.setdefault(key, found[0][1])
    return out
