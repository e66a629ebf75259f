"""The framework adapters: recognising training objects' types without importing their packages, what a
framework object holds by the framework's own API, its step counters, and sharded tensors.

A Lightning ``Trainer``, a transformers ``Trainer`` and an accelerate ``Accelerator`` are recognised by module
and class name (``framework_of``), so nothing here imports torch or a framework; ``framework_items`` lists the
model, optimizers, schedulers and loaders each holds; ``unwrap_optimizer`` and ``unwrap_scheduler`` reach
through a framework's wrapper to the object that owns the state. The object finder (``finder``) keeps what
these find; the checkpoint action reads a framework's objects with ``objects_of`` and sets its step counters
back with ``restore_counters``.

Under FSDP2 (``fully_shard``) parameters, gradients and optimizer state are DTensors. Any reduction of a
DTensor (``.sum()``, a norm, ``.item()``) redistributes it: a collective issued on this rank alone, which the
other ranks never match, and the job hangs. The probe never issues one: it reads the local shard
(``_local_tensor``, what ``DTensor.to_local()`` returns without communicating), and says its figures are this
rank's (``is_sharded``, ``local``, ``placement``).
"""

from __future__ import annotations

import sys
from typing import Any

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
    return tuple(
        t
        for t in (
            getattr(getattr(torch, "amp", None), "GradScaler", None),
            getattr(getattr(torch.cuda, "amp", None), "GradScaler", None),
        )
        if isinstance(t, type)
    )


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
    """Set a framework object's step counters to ``counters`` (as ``framework_counters`` wrote them);
    return what was set.

    Lightning gets ``global_step`` and ``current_epoch`` back; a transformers Trainer its
    ``global_step`` only (it recomputes ``state.epoch`` at every step from its own loop's epoch
    counter, a local variable of its training loop, so a value set from outside would not last);
    an accelerate ``Accelerator`` its ``step`` (the gradient-accumulation counter that
    ``accelerator.accumulate`` advances, restored as accelerate's own ``load_state`` does).
    """
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
