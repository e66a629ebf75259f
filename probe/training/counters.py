"""Framework step counters: read into a checkpoint, set back when it is loaded.

Lightning's ``global_step``/``current_epoch``, a transformers Trainer's ``global_step``, an
accelerate ``Accelerator``'s ``step``; the objects come from the one finder.
"""

from __future__ import annotations

from ..util.errorlog import record_error
from .finder import frameworks
from .frameworks import framework_of

__all__ = ["framework_counters", "restore_counters", "status"]


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


def status() -> dict:
    """The framework's own step beside probe's (a status provider): ``framework_step`` and where it comes
    from (``framework_counter``, e.g. ``trainer.global_step``), from the first Trainer or Accelerator
    found; nothing without one. probe counts the optimizer steps it saw, from 1 when it started: after
    ``probe inject`` into a run at step 5000 the two differ, and the framework's is the run's."""
    for name, counters in framework_counters(refresh=False).items():
        for key in ("global_step", "step"):
            if key in counters:
                return {"framework_step": counters[key], "framework_counter": f"{name}.{key}"}
    return {}
