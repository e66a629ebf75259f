"""Wiring torch to the probe: hooks installed when torch appears, and the explicit API.

``arm()`` is called when the probe starts. It never imports torch: if torch is already
imported the hooks go in at once, else a ``sys.meta_path`` finder waits for ``import
torch`` to finish and installs them then (PROBE=1 starts the probe before the training
script imports torch). The hooks: torch's global optimizer step post-hook (the step
boundary) and, on sampled steps only, the tracer's global module forward hooks.

``probe.step()`` and ``probe.watch()`` are for loops torch's hooks cannot see.
"""

from __future__ import annotations

import sys
import threading

from .._core import state as agent_state
from ..util.errorlog import record_error
from ..util.usercode import user_frame
from . import counters, finder, signals
from .steps import StepTracker
from .trace import Tracer

__all__ = ["arm", "disarm", "pause", "resume", "tracker", "tracer", "step", "watch"]

_lock = threading.RLock()
_state: dict = {}
lr_overrides = None  # probe.actions.lroverride puts itself here when imported: its overrides apply around each step


class _TorchWatcher:
    """A meta-path finder that lets the normal finders load torch, then installs the hooks."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or _state.get("installed"):
            return None
        for meta_finder in sys.meta_path:
            if meta_finder is self or not hasattr(meta_finder, "find_spec"):
                continue
            spec = meta_finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        original = getattr(loader, "exec_module", None)
        if original is None:
            return None

        def exec_module(module):
            original(module)
            _remove_watcher()
            _install(module)

        try:
            loader.exec_module = exec_module
        except AttributeError:
            return None
        return spec

    def invalidate_caches(self):
        pass


def _remove_watcher() -> None:
    watcher = _state.pop("watcher", None)
    if watcher is not None:
        try:
            sys.meta_path.remove(watcher)
        except ValueError:
            pass


def arm() -> None:
    """Install the torch hooks now if torch is imported, else as soon as it is. Idempotent."""
    with _lock:
        if _state.get("installed") or _state.get("watcher"):
            return
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "optim"):
            _install(torch)
        else:
            watcher = _TorchWatcher()
            _state["watcher"] = watcher
            sys.meta_path.insert(0, watcher)


def _install(torch) -> None:
    with _lock:
        if _state.get("installed"):
            return
        try:
            import torch.optim.optimizer as topt

            tr = Tracer(torch)
            tk = StepTracker(torch, tr)
            _state.update(tracker=tk, tracer=tr)
            handle = topt.register_optimizer_step_post_hook(_post_hook)
            _state.update(installed=True, handle=handle, pre_handle=topt.register_optimizer_step_pre_hook(_pre_hook))
            agent_state.add_status_provider(status)
            agent_state.add_status_provider(counters.status)  # a Trainer's own step beside probe's
            tr.prepare(1)  # step 1 is sampled: trace it from the first module call
        except Exception as exc:
            record_error("installing torch hooks", exc)


def _pre_hook(optimizer, args, kwargs):
    """torch's global optimizer step pre-hook: whether the step evaluates a closure (for the loss). Runs on
    every step: a step given no closure, after one that closed normally, has nothing to note."""
    tk = _state.get("tracker")
    if tk is not None:  # only a closure's first backward counts (accelerate passes closure=None by position)
        closure = args[1] if len(args) > 1 else kwargs.get("closure") if kwargs else None  # args[0]: the optimizer
        if closure is not None or tk.capture.closure_step:
            try:
                tk.capture.on_step_start(closure)  # the boundary ends it (Lightning: every step has one)
            except Exception as exc:
                record_error("torch optimizer step pre-hook", exc)
    lr = lr_overrides
    if lr is not None and lr.overrides:
        lr.around_step(optimizer, True)
    sig = signals.armed  # torch.updates: the update of the step after a measured one
    if sig is not None:
        sig.before_step(optimizer)
    return None


def _post_hook(optimizer, args, kwargs):
    """torch's global optimizer step post-hook: the step boundary."""
    lr = lr_overrides
    if lr is not None and lr.overrides:
        lr.around_step(optimizer, False)  # the loop's own lr back in param_groups before the boundary reads it
    tk = _state.get("tracker")
    if tk is not None:
        try:
            tk.on_optimizer_step(optimizer)
        except Exception as exc:
            record_error("torch optimizer step hook", exc)


def pause() -> None:
    """Take every torch hook out but keep the tracker, tracer and their rows (``resume`` puts them back).

    The benchmarks alternate paused and running blocks on one model to measure the
    hooks' cost in a long run's steady state.
    """
    with _lock:
        for key in ("handle", "pre_handle"):
            handle = _state.pop(key, None)
            if handle is not None:
                handle.remove()
        tk, tr = _state.get("tracker"), _state.get("tracer")
        if tr is not None:
            tr.close()
        if tk is not None:
            tk.close()


def resume() -> None:
    with _lock:
        tk, tr = _state.get("tracker"), _state.get("tracer")
        if tk is None or _state.get("handle") is not None:
            return
        import torch.optim.optimizer as topt

        _state["handle"] = topt.register_optimizer_step_post_hook(_post_hook)
        _state["pre_handle"] = topt.register_optimizer_step_pre_hook(_pre_hook)
        tk.reopen()
        tr.prepare(tk.step + 1)


def disarm() -> None:
    """Remove every torch hook the probe installed (the rings keep their rows)."""
    with _lock:
        _remove_watcher()
        for key in ("handle", "pre_handle"):
            handle = _state.pop(key, None)
            if handle is not None:
                handle.remove()
        for key in ("tracer", "tracker"):
            obj = _state.get(key)
            if obj is not None:
                obj.close()
        _state.pop("installed", None)


def tracker():
    """The step tracker, or None before torch is imported."""
    return _state.get("tracker")


def tracer():
    return _state.get("tracer")


def status() -> dict:
    tk = _state.get("tracker")
    return tk.status() if tk is not None else {"state": "idle"}


def _ready_tracker():
    tk = _state.get("tracker")
    if tk is None and sys.modules.get("torch") is not None:
        arm()
        tk = _state.get("tracker")
    return tk


def step(loss=None, samples=None, tokens=None) -> int | None:
    """Mark the end of a training step explicitly, for loops torch's optimizer hook cannot see.

    ``loss`` may be a tensor (read later, without a device sync) or a number; ``samples``
    and ``tokens`` processed in this step give samples/s and tokens/s. Once called, these
    calls own the step count. Returns the step number, or None if torch is not imported.
    """
    try:
        tk = _ready_tracker()
        if tk is None:
            return None
        tk.explicit = True
        tk.boundary(None, user_frame(sys._getframe(1))[0], loss=loss, samples=samples, tokens=tokens)
        return tk.step
    except Exception as exc:
        record_error("probe.step", exc)
        return None


def watch(model=None, optimizer=None, scheduler=None, scaler=None) -> None:
    """Name the training objects explicitly; ``optimizer`` becomes the one whose steps are counted."""
    try:
        caller = sys._getframe(1).f_locals
        tk = _ready_tracker()

        def name(obj):
            return next((k for k, v in caller.items() if v is obj), None)

        for m in model if isinstance(model, (list, tuple)) else [model]:
            if m is not None:
                finder.add(m, name(m), "watch", "model")
        for obj, kind in ((optimizer, "optimizer"), (scheduler, "scheduler"), (scaler, "scaler")):
            if obj is not None:
                finder.add(obj, name(obj), "watch", kind)
        if optimizer is not None and tk is not None:
            tk.set_lead(optimizer)
        if tk is not None:
            tk.watch_roots()
    except Exception as exc:
        record_error("probe.watch", exc)
