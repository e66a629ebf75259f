"""Step bookkeeping: one ``torch.steps`` row per training step, and the step boundary.

What counts as a step:

* The *lead* optimizer's ``step()`` ends a training step. The lead is the optimizer
  given to ``probe.watch(optimizer=...)``, else the first optimizer seen stepping.
  Other optimizers' steps (a GAN's second optimizer, a separate embedding optimizer)
  are counted in ``torch.optimizer`` but do not advance the step.
* Gradient accumulation needs nothing: the optimizer steps once per N micro-batches,
  so a step is N micro-batches; ``micro_batches``, samples and tokens add up over them.
* Once ``probe.step()`` is called, the explicit calls own the count and optimizer steps
  no longer end steps (no double counting).

The loss of a step is what the loop backpropagated since the previous step: every
scalar tensor ``torch.autograd.backward`` (so ``Tensor.backward``, accelerate's
``accelerator.backward``, Lightning's and the HF Trainer's backward) was called on,
summed; ``scaler.scale(loss)`` counts as ``loss`` (GradScaler's scale is looked
through), ``(loss / accum).backward()`` over ``accum`` micro-batches sums to their
mean, and inside ``optimizer.step(closure)`` only the closure's first evaluation
counts (the value ``step`` returns; LBFGS evaluates it again). A loop that never
calls backward on a scalar (``torch.autograd.grad``) falls back to a scalar tensor
named ``loss`` (PROBE_LOSS_NAMES) in the training loop's frames; ``probe.step(loss=)``
overrides both.

The hot path never synchronises with a device: the loss and the gradient norm
(a foreach norm launched on the device) are kept as tensors and read a few steps
later or when a query asks, once they are ready. Until then, or when there is no
such value, the ring holds None (SQL NULL); a loss that is NaN or infinite is kept as
it is, so ``isnan(loss)`` finds the step it went bad.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import sys
import threading
import time

from . import finder, safepoint
from .._config import setting
from .._runtime import rank_identity
from ..util.errorlog import record_error
from ..util.frames import release
from ..util.ring import Ring

__all__ = ["StepTracker", "STEP_COLUMNS"]

STEP_COLUMNS = {"step": "i8", "started_at": "f8", "ended_at": "f8", "duration": "f8", "loss": "f8",
                "grad_norm": "f8", "lr": "f8", "samples_per_s": "f8", "tokens_per_s": "f8",
                "peak_allocated": "f8", "rank": "f8", "traced": "b1", "samples": "f8", "tokens": "f8",
                "micro_batches": "i8", "optimizer": "O"}
_LAG = 2  # steps after which a pending value is read on the training thread
_RESOLVE_EVERY = 8  # pending device values read at the boundary once this many are waiting
_PEAK_PERIOD = 0.25  # seconds between peak-memory readings at the boundary (a running peak: staleness is fine)


def _outside(frame):
    """``(f, hops)``: the first frame from ``frame`` outwards that is the user's (not torch, probe or a
    training framework's), and how many frames out it is."""
    hops = 0
    is_internal = finder.is_internal
    while frame is not None and is_internal(frame.f_code):
        frame, hops = frame.f_back, hops + 1
    return frame, hops


def _attempt(source: str, fn, *args):
    """``fn(*args)``, or NaN with the error recorded: one failing measurement never costs the step."""
    try:
        return fn(*args)
    except Exception as exc:
        record_error(source, exc)
        return float("nan")


class StepTracker:
    def __init__(self, torch, tracer):
        self.torch = torch
        self.tracer = tracer
        self.torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
        self.ring = Ring(STEP_COLUMNS, setting("PROBE_STEPS_CAPACITY"))
        self.rank = rank_identity()["rank"]
        self._rank_v = float("nan") if self.rank is None else float(self.rank)
        # An integer batch of two or more dimensions is token ids (features are floating point).
        self._token_dtypes = {getattr(torch, n) for n in ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32",
                                                             "uint64") if hasattr(torch, n)}
        self.loss_names = setting("PROBE_LOSS_NAMES") or ["loss"]
        self.step = 0
        self.explicit = False
        self.lead = None  # weakref to the lead optimizer
        self.last_end_perf: float | None = None
        self.last_end_wall: float | None = None
        self.started_perf = time.perf_counter()
        self.started_wall = time.time()
        self.samples = 0.0
        self.tokens = 0.0
        self.micro_batches = 0
        self.pending: list = []  # (ring row, column, value holder)
        self._lock = threading.Lock()
        self._root_hooks: dict = {}
        self._scanned_at = 0
        self._norm_failed: set = set()
        self.wall_offset = time.time() - time.perf_counter()
        self._clip_norm = None
        self._norm_next = 1  # the next step that computes its own grad norm
        self._norm_budget = setting("PROBE_GRAD_NORM")
        self._peak_at = -1.0
        self._peak_v = float("nan")
        self._frame = None
        self._frame_depth = 0
        self._losses: list = []  # this step's backpropagated scalars (detached), summed at the boundary
        self._scaled = None  # (weakref to GradScaler.scale's output, the loss it scaled)
        self._closure_step = False  # inside optimizer.step(closure): only the closure's first backward counts
        self._closure_taken = False
        self.step_lr = None  # the lr an override made this step use (set by probe._lr before the boundary)
        _attempt("torch steps: wrapping clip_grad_norm_", self._wrap_clip)
        _attempt("torch steps: wrapping torch.autograd.backward", self._wrap_backward)

    # -- the lead optimizer --------------------------------------------------------------------
    def set_lead(self, optimizer) -> None:
        import weakref

        optimizer, _ = finder.unwrap_optimizer(optimizer)  # the hooks fire with the inner optimizer
        self.lead = weakref.ref(optimizer)
        finder.add(optimizer, None, "step hook", "optimizer")

    def lead_optimizer(self):
        return self.lead() if self.lead is not None else None

    def on_optimizer_step(self, optimizer) -> None:
        """torch's global optimizer step post-hook lands here."""
        self._closure_step = False
        lead = self.lead() if self.lead is not None else None
        if lead is None:
            self.set_lead(optimizer)
        elif lead is not optimizer:
            if finder.optimizer_found(optimizer) is None:
                finder.add(optimizer, None, "step hook", "optimizer")
            return
        if self.explicit:
            return
        self.boundary(optimizer, self._loop_frame())

    def _loop_frame(self):
        """The training loop's frame: the first one outside torch and probe above the step hook.

        The loop calls ``optimizer.step()`` from the same frame at the same depth every
        step, so the last answer is checked with one ``sys._getframe`` before walking.
        """
        depth = self._frame_depth
        if depth:
            try:
                f = sys._getframe(depth)
            except ValueError:
                f = None
            if f is not None and f is self._frame:
                return f
        f, hops = _outside(sys._getframe(1))
        self._frame_depth = 1 + hops if f is not None else 0
        return f

    # -- inputs: samples and tokens per step -------------------------------------------------
    def _root_pre_hook(self, module, args, kwargs):
        torch = self.torch
        if not torch.is_grad_enabled():
            return None  # an evaluation pass is not a training micro-batch
        x = args[0] if args else next(iter(kwargs.values()), None) if kwargs else None
        if type(x) is dict:
            x = next((v for v in x.values() if isinstance(v, torch.Tensor)), None)
        if isinstance(x, torch.Tensor):
            shape = x.shape
            if shape:
                self.micro_batches += 1
                self.samples += shape[0]
                if len(shape) >= 2 and x.dtype in self._token_dtypes:
                    self.tokens += x.numel()
        return None

    def _primary_model(self):
        """The root model holding the lead optimizer's parameters, else the first model found."""
        found = finder.models()
        lead = self.lead_optimizer()
        if lead is not None and lead.param_groups and lead.param_groups[0]["params"]:
            first = lead.param_groups[0]["params"][0]
            for f in found:
                if any(p is first for p in f.obj.parameters()):
                    return f.obj
        return found[0].obj if found else None

    def _watch_roots(self) -> None:
        """Count samples and tokens at the primary model's forward (one hook on one module, not global)."""
        model = self._primary_model()
        if model is None or id(model) in self._root_hooks:
            return
        self.close_root_hooks()
        try:
            self._root_hooks[id(model)] = model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True)
        except Exception as exc:
            record_error("torch steps: root model hook", exc)

    # -- lazily read values ---------------------------------------------------------------------
    def _hold(self, value):
        """A float now when that costs no device sync, else a holder to read later."""
        if type(value) is float:
            return value
        torch = self.torch
        if isinstance(value, torch.Tensor):
            if not value.is_cuda:
                if value.is_cpu:
                    return float(value.item())  # nothing to wait for (a non-scalar raises: recorded, missing)
                return (value.detach(), None)  # another accelerator (MPS, XLA): read later, not in this step
            if value.numel() != 1:
                return None
            value = value.detach()
            try:
                host = torch.empty((), dtype=value.dtype, device="cpu", pin_memory=True)
                host.copy_(value.reshape(()), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                return (host, ev)
            except Exception as exc:
                record_error("torch steps: copying a device scalar", exc)
                return None
        try:
            return float(value)
        except (TypeError, ValueError):
            return None

    @staticmethod
    def _read(holder):
        """The value behind a holder, or None while its device copy has not landed."""
        host, ev = holder
        if ev is not None and not ev.query():
            return None
        return float(host.item())

    def resolve(self, up_to_row: int | None = None) -> None:
        """Read pending loss and grad-norm values (those ready; up to a ring row if given)."""
        with self._lock:
            keep = []
            for row, col, holder in self.pending:
                if self.ring.count - row > self.ring.capacity:
                    continue
                if up_to_row is not None and row > up_to_row:
                    keep.append((row, col, holder))
                    continue
                try:
                    v = self._read(holder)
                except Exception as exc:
                    record_error(f"torch steps: reading {col}", exc)
                    continue
                if v is None:
                    keep.append((row, col, holder))
                else:
                    self.ring.set(col, row, v)
            self.pending = keep

    # -- the boundary -----------------------------------------------------------------------------
    def _find_loss(self, frame):
        f, n = frame, 0
        while f is not None and n < 3:
            loc = f.f_locals
            try:
                for name in self.loss_names:
                    v = loc.get(name)
                    if v is None:
                        continue
                    if isinstance(v, self.torch.Tensor):
                        if v.numel() == 1:  # not a per-sample loss vector: look further out for the scalar
                            return v
                    elif isinstance(v, (float, int)):
                        return v
            finally:
                release(f, loc, own=True)  # else 3.11/3.12's cached snapshot keeps last step's tensors alive
            f, n = f.f_back, n + 1
        return None

    def _step_grad_norm(self, optimizer, step: int, duration: float):
        """clip_grad_norm_'s result when the loop clipped, else our own norm.

        The boundary calls this from step ``_norm_next`` on. After computing a norm that cost
        ``c`` on a step of ``d`` seconds, the next one is ``c / (budget * d)`` steps later, so
        our computation stays within PROBE_GRAD_NORM's share of the step time (0.1 % by
        default); steps 1-3 always get one (start-up divergence shows there).
        """
        clipped, self._clip_norm = self._clip_norm, None
        if clipped is not None:
            return clipped
        budget = self._norm_budget
        t0 = time.perf_counter()
        norm = self._grad_norm(optimizer)
        cost = time.perf_counter() - t0
        gap = 1
        if duration > 0 and budget != float("inf"):
            gap = max(1, math.ceil(cost / (budget * duration)))
        self._norm_next = step + 1 if step < 3 else step + gap
        return norm

    def _wrap_clip(self) -> None:
        """Keep the total norm that torch.nn.utils.clip_grad_norm_ computes anyway (the norm before clipping)."""
        utils = self.torch.nn.utils
        original = utils.clip_grad_norm_
        if getattr(original, "_probe_original", None) is not None:
            return
        tracker = self

        @functools.wraps(original)
        def clip_grad_norm_(*args, **kwargs):
            total = original(*args, **kwargs)
            tracker._clip_norm = total
            return total

        clip_grad_norm_._probe_original = original
        utils.clip_grad_norm_ = clip_grad_norm_

    # -- the loss: what backward was called on ------------------------------------------------
    def on_step_start(self, optimizer, args, kwargs) -> None:
        """torch's global optimizer step pre-hook: note whether this step evaluates a closure."""
        self._closure_step = bool(args) or kwargs.get("closure") is not None
        self._closure_taken = False

    def _saw_backward(self, tensors, grad_tensors) -> None:
        t = tensors
        if type(t) in (list, tuple):
            if len(t) != 1:
                return
            t = t[0]
        if not isinstance(t, self.torch.Tensor) or t.numel() != 1:
            return  # a vector backward with explicit gradients is not a loss
        if grad_tensors is not None and not (type(grad_tensors) in (list, tuple) and all(g is None for g in grad_tensors)):
            return
        if self._closure_step:
            if self._closure_taken:
                return
            self._closure_taken = True
        scaled = self._scaled
        if scaled is not None and scaled[0]() is t:
            t = scaled[1]
            self._scaled = None
        self._losses.append(t.detach())

    def _wrap_backward(self) -> None:
        """See every ``torch.autograd.backward`` call (``Tensor.backward`` goes through it) and
        GradScaler's ``scale`` (so a scaled loss counts unscaled)."""
        import weakref

        autograd = self.torch.autograd
        original = autograd.backward
        if getattr(original, "_probe_original", None) is None:
            tracker = self

            @functools.wraps(original)
            def backward(tensors, grad_tensors=None, *args, **kwargs):
                try:
                    tracker._saw_backward(tensors, grad_tensors)
                except Exception as exc:
                    record_error("torch steps: noting the loss", exc)
                return original(tensors, grad_tensors, *args, **kwargs)

            backward._probe_original = original
            autograd.backward = backward
        scaler = getattr(getattr(self.torch, "amp", None), "GradScaler", None)
        scale = getattr(scaler, "scale", None)
        if scale is not None and getattr(scale, "_probe_original", None) is None:
            tracker = self
            Tensor = self.torch.Tensor

            @functools.wraps(scale)
            def scale_(self_, outputs):
                out = scale(self_, outputs)
                if out is not outputs and isinstance(outputs, Tensor):
                    try:
                        tracker._scaled = (weakref.ref(out), outputs.detach())
                    except TypeError:
                        pass
                return out

            scale_._probe_original = scale
            scaler.scale = scale_

    def _unwrap_backward(self) -> None:
        autograd = self.torch.autograd
        original = getattr(autograd.backward, "_probe_original", None)
        if original is not None:
            autograd.backward = original
        scaler = getattr(getattr(self.torch, "amp", None), "GradScaler", None)
        original = getattr(getattr(scaler, "scale", None), "_probe_original", None)
        if original is not None:
            scaler.scale = original
        self._losses.clear()
        self._scaled = None

    def _step_loss(self):
        """This step's backpropagated loss (a tensor, summed on its device), or None."""
        losses = self._losses
        if not losses:
            return None
        self._losses = []
        if len(losses) == 1:
            return losses[0]
        try:
            first = losses[0]
            return self.torch.stack([x.reshape(()).to(first.device, first.dtype) for x in losses]).sum()
        except Exception as exc:
            record_error("torch steps: summing the step's losses", exc)
            return losses[-1]

    def _unwrap_clip(self) -> None:
        utils = self.torch.nn.utils
        original = getattr(utils.clip_grad_norm_, "_probe_original", None)
        if original is not None:
            utils.clip_grad_norm_ = original

    def _grad_norm(self, optimizer):
        if optimizer is None or id(optimizer) in self._norm_failed:
            return None
        torch = self.torch
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return None
        try:
            with torch.no_grad():
                norms = torch._foreach_norm(grads)
                try:
                    return torch.linalg.vector_norm(torch.stack(norms))
                except RuntimeError:  # gradients on several devices
                    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        except Exception as exc:  # sparse gradients, mixed devices: stop trying for this optimizer
            self._norm_failed.add(id(optimizer))
            record_error("torch steps: grad norm", exc)
            return None

    def _peak(self, now: float) -> float:
        """The peak so far, read at most every ``_PEAK_PERIOD`` seconds (a peak only grows)."""
        if now - self._peak_at < _PEAK_PERIOD:
            return self._peak_v
        self._peak_at = now
        try:
            if self.tracer.cuda:
                self._peak_v = float(self.torch.cuda.max_memory_allocated())
            else:
                self._peak_v = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        except Exception:
            self._peak_v = float("nan")
        return self._peak_v

    def boundary(self, optimizer, frame, *, loss=None, samples=None, tokens=None) -> None:
        """Close step ``self.step + 1``: one ring row, then the tracer's and the subscribers' turn.

        This runs between two steps on the training thread, with the step's work just
        evicted from the CPU caches, so it touches as little as it can: one tuple into the
        ring's tail, no device syncs, and torch calls only for values it must keep.
        """
        end_perf = time.perf_counter()
        self.step = step = self.step + 1
        if frame is not self._frame:
            self._frame = frame
            finder.set_training_frame(frame)
        if optimizer is None:
            optimizer = self.lead_optimizer()
        if step >= 2 * self._scanned_at or step == 1:  # steps 1, 2, 4, 8, ...: cheap enough, catches late models
            self._scanned_at = step
            try:
                finder.scan(frame)
                self._watch_roots()
            except Exception as exc:
                record_error("torch steps: discovery", exc)
        start_perf = self.last_end_perf
        if start_perf is None:
            start_perf = self.tracer.first_call_perf() or self.started_perf
        duration = end_perf - start_perf if end_perf > start_perf else 0.0
        loss_v = norm_v = lr = None  # None: missing (NULL); a NaN loss stays NaN
        try:
            found = self._step_loss()
            if loss is None:
                loss = found if found is not None else self._find_loss(frame)
            if loss is not None:
                loss_v = self._hold(loss)
        except Exception as exc:
            record_error("torch steps: loss", exc)
        if self._clip_norm is not None or (self._norm_budget and step >= self._norm_next):
            try:
                norm = self._step_grad_norm(optimizer, step, duration)
                norm_v = None if norm is None else self._hold(norm)
            except Exception as exc:
                record_error("torch steps: grad norm", exc)
        if self.step_lr is not None:
            lr, self.step_lr = self.step_lr, None
        elif optimizer is not None:
            try:
                lr = optimizer.param_groups[0]["lr"]
                if type(lr) is not float:
                    lr = self._hold(lr)  # a tensor lr (capturable optimizers), or an int
            except Exception as exc:
                record_error("torch steps: lr", exc)
        s = float(samples) if samples is not None else (self.samples or None)
        t = float(tokens) if tokens is not None else (self.tokens or None)
        tracer = self.tracer
        traced = tracer.active_step == step
        ring = self.ring
        row = ring.count
        ring.append(step, start_perf + self.wall_offset, end_perf + self.wall_offset, duration,
                    loss_v if type(loss_v) is float else None, norm_v if type(norm_v) is float else None,
                    lr if type(lr) is float else None, s / duration if s is not None and duration > 0 else None,
                    t / duration if t is not None and duration > 0 else None,
                    self._peak_v if end_perf - self._peak_at < _PEAK_PERIOD else self._peak(end_perf), self._rank_v,
                    traced, s, t,
                    self.micro_batches, type(optimizer).__name__ if optimizer is not None else None)
        if type(loss_v) is tuple or type(norm_v) is tuple or type(lr) is tuple:  # device values read later
            with self._lock:
                for col, v in (("loss", loss_v), ("grad_norm", norm_v), ("lr", lr)):
                    if type(v) is tuple:
                        self.pending.append((row, col, v))
            if len(self.pending) >= _RESOLVE_EVERY:
                self.resolve(up_to_row=row - _LAG)
        self.last_end_perf = end_perf
        self.last_end_wall = end_perf + self.wall_offset
        self.samples = self.tokens = 0.0
        self.micro_batches = 0
        try:
            if traced:
                tracer.finish(step, self.wall_offset)
            if tracer.pending_events:
                tracer.resolve()
            if tracer.handles or tracer.sampled(step + 1):
                tracer.prepare(step + 1)
            else:
                tracer.active_step = None
        except Exception as exc:
            record_error("torch trace: step boundary", exc)
        if safepoint._subscribers:
            safepoint.fire(safepoint.StepEvent(step, frame, optimizer))
        else:
            safepoint.last_step = step

    # -- status -------------------------------------------------------------------------------------
    def status(self) -> dict:
        if self.step == 0:
            return {"state": "idle"}
        import numpy as np

        n = min(len(self.ring), 20)
        recent = self.ring.snapshot()["duration"][-n:] if n else []
        return {"step": self.step, "last_step_at": self.last_end_wall,
                "step_time": float(np.median(recent)) if n else None, "state": "training"}

    def close(self) -> None:
        self._unwrap_clip()
        self._unwrap_backward()
        self.close_root_hooks()

    def reopen(self) -> None:
        """Undo ``close``: the clip wrapper and the root model's hook go back; the next step's clock restarts."""
        _attempt("torch steps: wrapping clip_grad_norm_", self._wrap_clip)
        _attempt("torch steps: wrapping torch.autograd.backward", self._wrap_backward)
        self._watch_roots()
        self.last_end_perf = None
        self.started_perf = time.perf_counter()

    def close_root_hooks(self) -> None:
        for h in self._root_hooks.values():
            try:
                h.remove()
            except Exception:
                pass
        self._root_hooks.clear()
