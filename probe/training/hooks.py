"""Wiring torch to the probe: hooks installed when torch appears, and the explicit API.

``arm()`` is called when the probe starts. It never imports torch: if torch is already
imported the hooks go in at once, else a ``sys.meta_path`` finder waits for ``import
torch`` to finish and installs them then (PROBE=1 starts the probe before the training
script imports torch). The hooks: torch's global optimizer step post-hook (the step tracker's
``on_optimizer_step``: the step boundary), its pre-hook while a step needs one (the tracker's
``hook_before``: closures, the ``before_step`` callbacks of ``boundary``) and, on sampled steps only, the
tracer's global module forward hooks.

``probe.step()`` and ``probe.watch()`` are for loops torch's hooks cannot see; ``InputCounter`` counts what goes
into each step at the primary model.
"""

from __future__ import annotations

import sys
import threading
import weakref
from time import perf_counter_ns as _perf_ns

from .._core import state as agent_state
from ..util.errorlog import record_error
from ..util.objects import is_a
from ..util.usercode import user_frame
from . import finder, signals
from .steps import StepTracker
from .trace import Tracer

__all__ = ["arm", "disarm", "pause", "resume", "tracker", "tracer", "step", "watch", "InputCounter"]

_lock = threading.RLock()
_state: dict = {}


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
            tk = StepTracker(torch, tr, InputCounter(torch))
            _state.update(tracker=tk, tracer=tr)
            handle = topt.register_optimizer_step_post_hook(tk.on_optimizer_step)  # no wrapper between: per step
            _state.update(installed=True, handle=handle)
            tk.hook_before(True)  # the first steps are measured
            agent_state.add_status_provider(status)
            agent_state.add_status_provider(finder.framework_status)  # a Trainer's own step beside probe's
            tr.prepare(1)  # step 1 is sampled: trace it from the first module call
        except Exception as exc:
            record_error("installing torch hooks", exc)


def pause() -> None:
    """Take every torch hook out but keep the tracker, tracer and their rows (``resume`` puts them back).

    The benchmarks alternate paused and running blocks on one model to measure the
    hooks' cost in a long run's steady state.
    """
    with _lock:
        handle = _state.pop("handle", None)
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

        _state["handle"] = topt.register_optimizer_step_post_hook(tk.on_optimizer_step)
        tk.reopen()
        tr.prepare(tk.step + 1)


def disarm() -> None:
    """Remove every torch hook the probe installed (the rings keep their rows)."""
    with _lock:
        _remove_watcher()
        handle = _state.pop("handle", None)
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
    """The step counter's part of ``probe status`` (a status provider)."""
    tk = _state.get("tracker")
    if tk is None or tk.step == 0:
        return {"state": "idle"}
    import numpy as np

    recent = tk.ring.snapshot()
    # the last 20 steps' median; step 1's row times its work from the first module call only, not a whole step
    # (its data wait, and whatever the loop does after the optimizer, are not in it), so it is left out
    whole = np.asarray(recent["duration"][-20:])[np.asarray(recent["step"][-20:]) > 1]
    last = tk._last_ns
    return {
        "step": tk.step,
        "last_step_at": None if last is None else last * 1e-9 + tk.wall_offset,
        "step_time": float(np.median(whole)) if len(whole) else None,
        "state": "training",
    }


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


_TOKEN_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")


def _never() -> bool:
    return False


class InputCounter:
    """What goes into each training step, at the primary model's forward: micro-batches, samples and tokens.

    The primary model is the root model holding the lead optimizer's parameters (else the first model found).
    Two watchers sit on that one module, never a global hook: the counting forward pre-hook on measured steps
    only (each training forward call with a batch is a micro-batch, its first dimension the samples, an integer
    batch of two or more dimensions token ids), and on every step the clock of its calls (``_clock``: ``began``,
    when the step's first call began, which the step tracker reads for ``data_wait``). Evaluation passes (no
    grad) are not micro-batches. ``take`` hands the step's counts to the boundary and starts the next step's. The
    step tracker holds one (``StepTracker.inputs``), made here so that ``steps`` needs nothing of the hooks."""

    def __init__(self, torch):
        self.torch = torch
        self.began = 0  # perf_counter_ns when this step's first call of the model began (the tracker resets it)
        self.samples = 0.0
        self.tokens = 0.0
        self.micro_batches = 0
        self.root = None  # weakref to the primary model
        self.counting = None  # the counting hook's handle, present on measured steps only
        self._first = None  # the first-forward hook's handle
        self._token_dtypes = {getattr(torch, n) for n in _TOKEN_DTYPES if hasattr(torch, n)}
        # True while dynamo traces a compiled function that calls the model: the watchers then do nothing, so
        # that they add no graph break (an error under fullgraph=True) and no guard on their state. Dynamo
        # answers is_dynamo_compiling True as a constant; run, it returns False, one call (is_compiling asks
        # torch.jit.is_scripting first: two). Before torch 2.3 neither exists and they break the graph as any
        # hook does.
        compiler = getattr(torch, "compiler", None)
        compiling = getattr(compiler, "is_dynamo_compiling", None) or getattr(compiler, "is_compiling", None)
        self._compiling = compiling if callable(compiling) else _never

    def pre_hook(self, module, args, kwargs):
        """The counting hook: one training forward call of the primary model."""
        torch = self.torch
        if self._compiling() or not torch.is_grad_enabled():
            return None  # an evaluation pass is not a training micro-batch
        x = args[0] if args else next(iter(kwargs.values()), None) if kwargs else None
        if type(x) is dict:
            x = next((v for v in x.values() if is_a(v, torch.Tensor)), None)
        if is_a(x, torch.Tensor):  # by type: the batch is the job's object
            shape = x.shape
            if shape:
                self.micro_batches += 1
                self.samples += shape[0]
                if len(shape) >= 2 and x.dtype in self._token_dtypes:
                    self.tokens += x.numel()
                sig = signals.signals()  # torch.batches: the step's input fingerprint
                if sig is not None:
                    sig.on_input(x)
        return None

    def take(self, samples=None, tokens=None) -> tuple:
        """``(micro_batches, samples, tokens)`` of the step just ended (``probe.step``'s own counts win), or
        ``(0, None, None)`` when nothing was counted; the next step counts from zero."""
        micro = self.micro_batches
        if not (micro or samples is not None or tokens is not None):
            return 0, None, None
        s = float(samples) if samples is not None else (self.samples or None)
        t = float(tokens) if tokens is not None else (self.tokens or None)
        self.samples = self.tokens = 0.0
        self.micro_batches = 0
        return micro, s, t

    @staticmethod
    def primary_model(lead):
        """The root model holding ``lead``'s (the lead optimizer's) parameters, else the first model found."""
        found = finder.models()
        if lead is not None and lead.param_groups and lead.param_groups[0]["params"]:
            first = lead.param_groups[0]["params"][0]
            for f in found:
                if any(p is first for p in f.obj.parameters()):
                    return f.obj
        return found[0].obj if found else None

    def watch(self, lead, counting: bool) -> None:
        """Put the hooks on the primary model (once it is known, or when it changed); ``counting``: the
        counting hook too (the next step is measured)."""
        model = self.primary_model(lead)
        if model is None or (self.root is not None and self.root() is model):
            return
        self.close()
        try:
            self.root = weakref.ref(model)
            self._first = self._clock(model)
        except Exception as exc:
            record_error("torch steps: root model hook", exc)
            self.root = None
            return
        self.count(counting)

    def _clock(self, model):
        """Make the step's first call of the root model note when it began (``began``); returns what ``close`` undoes.

        Through torch's own slot for a module's compiled call (``_compiled_call_impl``: unset unless
        ``module.compile()`` set it, and left out when the module is pickled or copied) while it is free: a
        forward pre-hook would put every call of the model on torch's slower path for hooked modules (a few µs
        a step). Else (the slot taken, a module with its own ``__call__``) a forward pre-hook."""
        module = self.torch.nn.Module
        if type(model).__call__ is module.__call__ and vars(model).get("_compiled_call_impl", module) is module:
            if getattr(model, "_compiled_call_impl", False) is None:
                call, ref, counter = type(model)._call_impl, weakref.ref(model), self  # no cycle through model
                compiling = self._compiling

                def clocked(*args, **kwargs):
                    if not compiling() and not counter.began:  # compiling first: no read of ``began`` traced
                        counter.began = _perf_ns()
                    return call(ref(), *args, **kwargs)

                model._compiled_call_impl = clocked
                return clocked
        return model.register_forward_pre_hook(self._began)

    def _began(self, module, args) -> None:
        """The forward pre-hook ``_clock`` falls back to."""
        if not self._compiling() and not self.began:
            self.began = _perf_ns()

    def count(self, on: bool) -> None:
        """Put the counting hook in (``on``) or take it out."""
        handle = self.counting
        if not on:
            if handle is not None:
                self.counting = None
                handle.remove()
            return
        model = self.root() if self.root is not None else None
        if handle is None and model is not None:
            try:
                self.counting = model.register_forward_pre_hook(self.pre_hook, with_kwargs=True)
            except Exception as exc:
                record_error("torch steps: root model hook", exc)
                self.root = None

    def close(self) -> None:
        """Take both watchers out (the probe pauses, or the primary model changes)."""
        try:
            self.count(False)
        except Exception:
            self.counting = None
        handle, self._first = self._first, None
        model = self.root() if self.root is not None else None
        self.root = None  # ``watch`` hooks the model again (a resume)
        try:
            if callable(getattr(handle, "remove", None)):
                handle.remove()
            elif model is not None and vars(model).get("_compiled_call_impl") is handle:
                del model._compiled_call_impl  # the class's None shows again (a compile since is left alone)
        except Exception:
            pass
