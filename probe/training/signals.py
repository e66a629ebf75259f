"""What a measured step's data, update and loss scaling were, for ``torch.batches``, ``torch.updates`` and
``torch.scaler`` (the doctor's signal rules read them):

* the batch: a fingerprint of the primary model's first training input of the step (a hash of at most
  ``_SAMPLE`` evenly strided elements) and of the targets the loss's classification term saved (its autograd
  graph's ``NllLossBackward0``), and the label counts of those targets (how many classes a batch holds, the most
  frequent and its share).
* the update: per weight tensor (two or more dimensions, trainable, held by the lead optimizer; ``_TENSORS`` at
  most, spread over the model), the size of the change one optimizer step made relative to the weights,
  ‖Δw‖/‖w‖ (and ‖w‖) over ``_UPDATE_SAMPLE`` strided elements of the step after a measured one: a ``before_step``
  registration at the step boundary reads the sample before that step and again before the next (after it),
  then removes itself. No hook of the optimizer's own is added (adding or removing one while torch runs its
  hooks breaks the step).
* the loss scaling: a GradScaler's scale at the measured boundary, and whether ``clip_grad_norm_`` ran on
  gradients that scaler had not unscaled yet (their norm is the scale times too large, and so is the clipping):
  the clip's norm is then divided by the scale, so ``torch.steps.grad_norm`` is the gradients' own.

Everything runs on measured steps only (``hooks.InputCounter``'s counting hook, the measured backward of
``capture``, the clip wrapper in on measured steps, the boundary's measured branch), and nothing synchronises with a
device: a device sample is copied off without blocking (``util.ring.copy_off``) and read at a later boundary once
its event has completed. Nothing raises into the training loop: errors go to ``probe.errors``.
"""

from __future__ import annotations

import hashlib
import time
import weakref

from ..config import setting
from ..util.errorlog import record_error
from ..util.ring import Ring
from . import finder
from ..util.ring import copy_off
from .._core.boundary import boundary

__all__ = ["Signals", "signals", "loss_term", "NLL", "BATCH_COLUMNS", "UPDATE_COLUMNS", "SCALER_COLUMNS"]

BATCH_COLUMNS = {
    "step": "i8",
    "time": "f8",
    "input_hash": "O",
    "target_hash": "O",
    "samples": "f8",
    "labels": "f8",
    "top_label": "f8",
    "top_share": "f8",
}
UPDATE_COLUMNS = dict(step="i8", time="f8", parameter="O", ratio="f8", grad_ratio="f8", lr="f8", norm="f8")
SCALER_COLUMNS = {"step": "i8", "time": "f8", "scale": "f8", "clip_scaled": "b1", "clip_norm": "f8"}

_SAMPLE = 256  # elements of an input or target tensor hashed
_LABELS = 4096  # target elements whose labels are counted
NLL = ("NllLossBackward0", "NllLoss2DBackward0")  # cross_entropy is log_softmax + nll_loss
_TENSORS = 32  # weight tensors whose update is measured
_UPDATE_SAMPLE = 1024  # elements of each
_REFRESH_MAX = 500  # steps between refreshes of the watched tensors at most
_PENDING_MAX = 8  # device reads waiting at most


def _strided(flat, n: int):
    """At most ``n`` evenly strided elements of the 1-d ``flat`` (a view, no copy of the whole)."""
    size = flat.numel()
    return flat if size <= n else flat[:: -(-size // n)]


def fingerprint(sample) -> str:
    """A hash of a host tensor's dtype, shape and values: the same data gives the same string on every rank.

    >>> import torch
    >>> fingerprint(torch.arange(6)) == fingerprint(torch.arange(6)) != fingerprint(torch.arange(1, 7))
    True
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(str(sample.dtype).encode())
    h.update(sample.contiguous().numpy().tobytes())
    return h.hexdigest()


def label_counts(labels, ignore_index: int | None = None) -> tuple:
    """``(labels, the most frequent, its share)`` of a host tensor of class indices (``ignore_index`` and
    negative ones left out), or ``(None, None, None)`` when none is left.

    >>> import torch
    >>> label_counts(torch.tensor([3, 3, 3, 1, -100]), -100)
    (2, 3, 0.75)
    """
    flat = labels.reshape(-1)
    keep = flat >= 0
    if ignore_index is not None:
        keep &= flat != ignore_index
    flat = flat[keep]
    if not flat.numel():
        return None, None, None
    values, counts = flat.unique(return_counts=True)
    top = int(counts.argmax())
    return int(values.numel()), int(values[top]), float(counts[top]) / flat.numel()


def loss_term(loss, names, limit: int = 64):
    """The first node of ``loss``'s graph (breadth first, ``limit`` at most) named in ``names``: its loss term."""
    fn = getattr(loss, "grad_fn", None)
    seen, queue = set(), [fn] if fn is not None else []
    while queue and len(seen) < limit:
        node = queue.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() in names:
            return node
        queue.extend(nf[0] for nf in node.next_functions)
    return None


def _targets(loss):
    """The class-index targets (and ignore_index) the classification term behind ``loss`` saved, or None."""
    node = loss_term(loss, NLL)
    return None if node is None else (getattr(node, "_saved_target", None), getattr(node, "_saved_ignore_index", None))


class _Watched:
    __slots__ = ("name", "param", "stride", "before", "grad")

    def __init__(self, name, param):
        self.name, self.param, self.before, self.grad = name, weakref.ref(param), None, None
        self.stride = -(-param.numel() // _UPDATE_SAMPLE)

    def sample(self):
        """A strided view of the tensor's elements (no copy for a contiguous tensor), or None when it is gone."""
        p = self.param()
        return None if p is None else p.detach().reshape(-1)[:: self.stride]

    def grad_sample(self):
        """The same elements of its gradient (as the optimizer is about to use it), or None."""
        p = self.param()
        g = None if p is None else p.grad
        if g is None or g.is_sparse or type(g) is not type(p.data) or g.shape != p.shape:
            return None
        return g.detach().reshape(-1)[:: self.stride]


class Signals:
    def __init__(self, torch):
        self.torch = torch
        capacity = setting("PROBE_STEPS_CAPACITY")
        self.batches = Ring(BATCH_COLUMNS, capacity)
        self.updates = Ring(UPDATE_COLUMNS, capacity)
        self.scaler = Ring(SCALER_COLUMNS, capacity)
        self._input = None  # this step's input sample (a host tensor, or a (pinned copy, event) pair)
        self._target = None  # (sample, label sample, ignore_index) of this step's loss
        self._clip = None  # (scale, clipped norm) when this step clipped gradients still scaled
        self._scaler = None  # weakref to the GradScaler that scaled a measured step's loss
        # clipping coefficients (tensors): the last measured step's, and the one of the update being measured
        self._coef = self._update_coef = None
        self._pending: list = []  # (step, kind, payload, event) of device samples not read yet
        self._opt = None  # weakref to the lead optimizer the tensors were picked for
        self._watched: list = []  # _Watched tensors, picked again at step _refresh_at
        self._refresh_at = 1
        self._phase = 0  # the update measured next: 1 before its step, 2 after it (its sample taken), 0 none
        self._update_step, self._lr = 0, None  # the step whose update is measured, and the lead optimizer's rate
        self.spent_ns = 0  # the update measurements' time since the tracker last took it into a step's probe_us

    # -- what the step saw (measured steps only) ----------------------------------------------------------------
    def on_input(self, x) -> None:
        """The primary model's training input (the counting hook of ``inputs``): the step's first is kept."""
        if self._input is not None or type(x) is not self.torch.Tensor:
            return  # the step's first only; a subclass (a DTensor) could make its reshape a collective
        try:
            x = x.detach()
            if not x.is_contiguous() and x.dim():  # a few whole samples, not a copy of the batch
                x = x[:: max(1, x.shape[0] // 8)]
            self._input = self._host(_strided(x.reshape(-1), _SAMPLE))
        except Exception as exc:
            record_error("torch batches: input", exc)

    def on_loss(self, loss) -> None:
        """The step's first backpropagated loss (``capture``, measured steps): the targets its term saved."""
        if self._target is not None:
            return
        try:
            found = _targets(loss)
            if found is None or found[0] is None:
                return
            t, ignore = found
            if type(t) is not self.torch.Tensor or t.is_floating_point() or not t.numel():
                return  # class probabilities, not indices (or a subclass)
            flat = t.detach().reshape(-1)
            sample, many = self._host(_strided(flat, _SAMPLE)), self._host(_strided(flat, _LABELS))
            if sample is not None and many is not None:
                self._target = (sample, many, ignore)
        except Exception as exc:
            record_error("torch batches: targets", exc)

    def on_scale(self, scaler) -> None:
        """GradScaler.scale on a measured step (``capture``'s wrapper): the scaler this loop uses."""
        if self._scaler is None or self._scaler() is not scaler:
            try:
                self._scaler = weakref.ref(scaler)
            except TypeError:
                pass

    def _scalers(self) -> list:
        """The GradScalers to read: the one a measured step's loss went through, then those the finder knows."""
        seen = self._scaler() if self._scaler is not None else None
        found = [f.obj for f in finder.known("scaler") if f.obj is not seen]
        return [seen, *found] if seen is not None else found

    def on_clip(self, total, max_norm=None):
        """``clip_grad_norm_``'s norm on a measured step: when a GradScaler holds the lead optimizer's gradients
        still scaled, the norm unscaled (kept for ``torch.scaler``); else ``total`` as it is. Its clipping
        coefficient (``max_norm`` over the norm, 1 at most) is kept for the next measured update."""
        try:
            opt = self._opt() if self._opt is not None else None
            if opt is None or type(total) is not self.torch.Tensor:
                return total
            if type(max_norm) in (float, int) and max_norm > 0:
                self._coef = (max_norm / (total.detach().float() + 1e-6)).clamp(max=1.0)
            for s in self._scalers():
                scale = getattr(s, "_scale", None)
                if scale is None or not s.is_enabled():
                    continue  # never used (scale() makes it), or off
                # no entry yet: neither unscale_ nor step has seen this optimizer since the last update()
                state = getattr(s, "_per_optimizer_states", {}).get(id(opt)) or {}
                stage = getattr(state.get("stage"), "name", "READY")
                if stage != "READY":
                    return total  # unscaled already (unscale_ was called): the norm is the gradients' own
                unscaled = total / scale
                self._clip = (scale, unscaled)
                return unscaled
        except Exception as exc:
            record_error("torch scaler: clip", exc)
        return total

    def _host(self, t):
        """``t`` on the host: a copy, or from CUDA a pinned copy made without blocking and its event; None on
        another device (reading it there could wait for it)."""
        if t.device.type == "cpu":
            return t.clone()
        return copy_off(self.torch, t) if t.is_cuda else None

    # -- the boundary ------------------------------------------------------------------------------------------
    def at_boundary(self, step: int, optimizer) -> None:
        """A measured step's boundary: its batch and scaler rows (device samples once they have landed), and the
        next optimizer step's update measured (its cost kept in ``spent_ns``)."""
        now = time.time()
        try:
            self._read_pending()
            inp, tgt, clip = self._input, self._target, self._clip
            self._input = self._target = self._clip = None
            if inp is not None or tgt is not None:
                self._later(step, now, "batch", (inp, tgt))
            if optimizer is not None:
                if self._opt is None or self._opt() is not optimizer or step >= self._refresh_at:
                    self._refresh_at = step + min(step, _REFRESH_MAX)
                    self._refresh(optimizer)
                self._scaler_row(step, now, clip)
                self._arm(step + 1)
        except Exception as exc:
            record_error("torch signals", exc)

    def _later(self, step, now, kind, payload) -> None:  # a row once its device samples have landed
        if len(self._pending) < _PENDING_MAX:
            self._pending.append((step, now, kind, payload))
        self._read_pending()

    def _read_pending(self) -> None:
        """Rows whose device samples have landed (all of a CPU job's at once), in order."""
        while self._pending:
            step, now, kind, payload = self._pending[0]
            if not _landed(payload):
                return
            self._pending.pop(0)
            try:
                if kind == "batch":
                    self._batch_row(step, now, *payload)
                elif kind == "scaler":
                    self._scaler_values(step, now, *payload)
                else:
                    self._update_rows(step, now, *payload)
            except Exception as exc:
                record_error(f"torch signals: {kind}", exc)

    def _batch_row(self, step, now, inp, tgt) -> None:
        inp_hash = fingerprint(_value(inp)) if inp is not None else None
        tgt_hash = samples = labels = top = share = None
        if tgt is not None:
            sample, many, ignore = tgt
            tgt_hash = fingerprint(_value(sample))
            many = _value(many)
            labels, top, share = label_counts(many, ignore)
            samples = float(many.numel())
        self.batches.append(step, now, inp_hash, tgt_hash, samples, labels, top, share)

    def _scaler_row(self, step, now, clip) -> None:
        s = next((s for s in self._scalers() if getattr(s, "_scale", None) is not None and s.is_enabled()), None)
        if s is None:
            return
        norm = clip[1] if clip is not None else None
        if not isinstance(norm, self.torch.Tensor):
            norm = None if norm is None else self.torch.tensor(float(norm))
        values = s._scale.reshape(1) if norm is None else self.torch.stack([s._scale.reshape(()), norm.reshape(())])
        held = self._host(values.float())
        if held is not None:
            self._later(step, now, "scaler", (held, clip is not None))

    def _scaler_values(self, step, now, values, clipped) -> None:
        v = _value(values).tolist()
        self.scaler.append(step, now, v[0], clipped, v[1] if len(v) > 1 else None)

    # -- the update of one optimizer step -----------------------------------------------------------------------
    def _refresh(self, optimizer) -> None:
        """The weight tensors whose update is measured: trainable, two or more dimensions, held by ``optimizer``,
        named by the model that holds them."""
        torch = self.torch
        self._opt = weakref.ref(optimizer)
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        names: dict = {}
        for f in finder.models():
            for n, p in f.obj.named_parameters():
                if id(p) in held:
                    names.setdefault(id(p), finder.module_path(n))
        chosen = [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if p.requires_grad and p.dim() >= 2 and p.is_floating_point() and type(p.data) is torch.Tensor
        ]
        if len(chosen) > _TENSORS:
            chosen = [chosen[round(i * (len(chosen) - 1) / (_TENSORS - 1))] for i in range(_TENSORS)]
        old = {id(w.param()): w for w in self._watched if w.param() is not None}
        watched = []
        for p in chosen:
            w = old.get(id(p))
            if w is None:
                w = _Watched(names.get(id(p), f"tensor {len(watched)}"), p)
            watched.append(w)
        self._watched = watched

    def _arm(self, step: int) -> None:
        """Measure the update of the lead optimizer's next step: ``before_step`` runs before the optimizer's steps
        (a registration at the step boundary) until it has read the weights after that step."""
        if self._phase or not self._watched:
            return
        self._phase, self._update_step = 1, step
        self._update_coef, self._coef = self._coef, None  # the loop clips the next step as it clipped this one
        boundary.before_step(self.before_step)

    def _disarm(self) -> None:
        self._phase = 0
        boundary.remove(self.before_step)

    def before_step(self, optimizer) -> None:
        """Before an optimizer step while an update is measured: the sample before the measured step (phase 1), then
        before the next step of the same optimizer (after it; phase 2). Outside the boundary's timing, so its time
        goes to ``spent_ns``: the tracker adds it to a full boundary's probe_us, which the step budget is charged."""
        opt = self._opt() if self._opt is not None else None
        if optimizer is not opt:
            if opt is None:
                self._disarm()
            return  # another optimizer's step (a GAN's second one)
        t0 = time.perf_counter_ns()
        try:
            with self.torch.no_grad():
                if self._phase == 1:
                    views = [(w, w.sample()) for w in self._watched]
                    views = [(w, v) for w, v in views if v is not None]
                    copies = self.torch._foreach_mul([v for _, v in views], 1.0)  # one call copies them all
                    for w in self._watched:
                        w.before = w.grad = None
                    for (w, _), c in zip(views, copies):
                        w.before = c
                    grads = [(w, w.grad_sample()) for w, _ in views]
                    grads = [(w, g) for w, g in grads if g is not None]
                    norms = self.torch._foreach_norm([g.float() for _, g in grads]) if grads else []
                    for (w, _), n in zip(grads, norms):
                        w.grad = n  # the gradient the step is about to apply, at the sampled elements
                    lr = optimizer.param_groups[0].get("lr")
                    self._lr = float(lr) if type(lr) in (float, int) else None
                    self._phase = 2
                    return
                self._disarm()
                self._measure_update()
        except Exception as exc:
            self._disarm()
            record_error("torch updates", exc)
        finally:
            self.spent_ns += time.perf_counter_ns() - t0

    def _measure_update(self) -> None:
        torch = self.torch
        names, before, after, grads = [], [], [], []
        for w in self._watched:
            b, now, g = w.before, w.sample(), w.grad
            w.before = w.grad = None
            if now is None or b is None:
                continue
            names.append(w.name)
            before.append(b.float())
            after.append(now.float())
            grads.append(g if g is not None else b.new_tensor(float("nan"), dtype=torch.float32))
        if not names:
            return
        # a few foreach kernels for all the tensors rather than a handful each
        moved = torch.stack(torch._foreach_norm(torch._foreach_sub(after, before)))
        size = torch.stack(torch._foreach_norm(before)).clamp_min(1e-30)
        pulled = torch.stack([g.to(size.device) for g in grads])
        coef = self._update_coef
        if coef is not None:  # the gradient before clipping: what the loss asked for
            pulled = pulled / coef.to(size.device)
        held = self._host(torch.stack([moved / size, pulled / size, size]))
        if held is not None:
            self._later(self._update_step, time.time(), "update", (held, names, self._lr))

    def _update_rows(self, step, now, ratios, names, lr) -> None:
        moved, pulled, size = _value(ratios).tolist()
        for name, r, g, n in zip(names, moved, pulled, size):
            self.updates.append(step, now, name, r, g if g == g else None, lr, n)

    def close(self) -> None:
        """Forget the update being measured (the probe pauses)."""
        self._disarm()

    def snapshot(self, which: str) -> dict:
        """The rows of ``which`` (batches, updates, scaler); device samples are read on the training thread."""
        return getattr(self, which).snapshot()


def _value(held):  # the host tensor of _host's result
    return held[0] if type(held) is tuple else held


def _landed(payload) -> bool:
    """Whether every device copy in ``payload`` (nested tuples and lists) has completed."""
    if type(payload) is tuple and len(payload) == 2 and hasattr(payload[1], "query"):
        return bool(payload[1].query())
    if type(payload) in (tuple, list):
        return all(_landed(p) for p in payload)
    return True


_instance: list = []


def signals(torch=None) -> Signals | None:
    """The process's Signals (made on the first call that passes torch), or None before that."""
    if not _instance and torch is not None:
        _instance.append(Signals(torch))
    return _instance[0] if _instance else None
