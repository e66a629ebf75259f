"""Values captured from the training loop for ``torch.steps``: the loss and the gradient norm (docs/torch.md).

The loss of a step is what the loop backpropagated since the previous step (``torch.autograd.backward``'s scalars,
summed; ``scaler.scale(loss)`` counts as ``loss``; a closure's first evaluation only; a step GradScaler skips has
none), noted on every step without a device sync (``hold``). Else a scalar named ``loss`` (PROBE_LOSS_NAMES) in the
loop's frames on measured steps; ``probe.step(loss=)`` overrides both. The gradient norm is ``clip_grad_norm_``'s
result when the loop clips (its wrapper is in on measured steps only), else a foreach norm of the lead optimizer's
gradients on their device; under FSDP2 both are this rank's local shards', never a collective.
"""

from __future__ import annotations

import functools
import time
import weakref

from ..config import setting
from ..util.errorlog import record_error
from ..util.usercode import release
from ..util.objects import is_a
from . import signals
from .frameworks import is_sharded, local
from ..util.ring import copy_off

__all__ = ["Capture", "loss_logits"]

_BCE_LOGITS = "BinaryCrossEntropyWithLogitsBackward0"
# nodes that only move or retype values: skipped when naming what made a loss term's input
_SHAPE = frozenset(
    "ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 TransposeBackward0 TBackward0 PermuteBackward0 "
    "SqueezeBackward0 SqueezeBackward1 UnsqueezeBackward0 CloneBackward0 ToCopyBackward0 ContiguousBackward0 "
    "ExpandBackward0 SliceBackward0 SelectBackward0 FlattenBackward0".split()
)
_LOSS_LOOK_EVERY = 1000  # backward calls between two looks at the loss's graph (also: each measured step's first)


def _made_by(node, depth: int = 3) -> str | None:
    """The operations that made a tensor (``node``: its ``grad_fn``), nearest first, up to ``depth`` of them, the
    ones that only reshape or retype skipped, following each node's first input: ``"A <- B <- C"``."""
    names = []
    hops = 0
    while node is not None and len(names) < depth and hops < 32:
        hops += 1
        name = node.name()
        if name == "torch::autograd::AccumulateGrad":  # a leaf: nothing made it
            break
        if name not in _SHAPE:
            names.append(name)
        nexts = node.next_functions
        node = nexts[0][0] if nexts else None
    return " <- ".join(names) or None


def loss_logits(loss, limit: int = 64):
    """``(node name, classes, logits shape, made by)`` of the classification term behind ``loss``, or None.

    Walks ``loss.grad_fn`` breadth first (at most ``limit`` nodes) to a negative log-likelihood node (or a
    ``binary_cross_entropy_with_logits`` one) and reads the shape of the log-probabilities (logits) it saved:
    classes are its dim 1 (``[N, C]``, ``[N, C, H, W]``) or dim 0 (``[C]``); NULL for the binary term. ``made by``
    names the operations that made that term's input (``_made_by``): ``LogSoftmaxBackward0 <- SoftmaxBackward0``
    means cross_entropy was given probabilities. Must run before the backward frees the saved tensors.

    >>> import torch
    >>> logits = torch.randn(6, 128, requires_grad=True)
    >>> loss_logits(torch.nn.functional.cross_entropy(logits, torch.zeros(6, dtype=torch.long)) / 2)
    ('NllLossBackward0', 128, '[6, 128]', 'LogSoftmaxBackward0')
    >>> x = torch.randn(6, 3, requires_grad=True)
    >>> loss_logits(torch.nn.functional.cross_entropy((x * 2).softmax(1), torch.zeros(6, dtype=torch.long)))[3]
    'LogSoftmaxBackward0 <- SoftmaxBackward0 <- MulBackward0'
    """
    node = signals.loss_term(loss, (*signals.NLL, _BCE_LOGITS), limit)
    x = getattr(node, "_saved_self", None) if node is not None else None
    if x is None or not x.dim():
        return None
    name = node.name()
    made = _made_by(node.next_functions[0][0]) if node.next_functions else None
    shape = list(x.shape)
    if name == _BCE_LOGITS:
        return name, None, str(shape), made
    return name, int(shape[1] if x.dim() >= 2 else shape[0]), str(shape), made


class Capture:
    def __init__(self, torch):
        # what ``saw_backward`` reads on every backward call first: they share a cache line (see StepTracker)
        self.Tensor = torch.Tensor
        self.losses: list = []  # this step's backpropagated scalars (floats, or detached tensors), summed at its end
        self.closure_step = False  # inside optimizer.step(closure): only the closure's first backward counts
        self.closures = False  # whether the loop has passed a closure (the pre-hook then stays in)
        self._scaled = None  # (weakref to GradScaler.scale's output, the loss it scaled)
        self.ends_step = None  # the tracker's: whether an optimizer step now ends the step (and takes its loss)
        self.wanted = True  # whether the step in progress is measured (its optional values read)
        self._loss_looks = 0
        self.torch = torch
        self.loss_names = setting("PROBE_LOSS_NAMES") or ["loss"]
        self.clip_norm = None  # clip_grad_norm_'s result in the step in progress
        self._clip = None  # the clip_grad_norm_ wrapper, in torch.nn.utils on measured steps only (``note``)
        self._closure_taken = False
        self._norm_failed: set = set()
        self.sharded = False  # a gradient norm was this rank's shards' (FSDP2/DTensor), not the model's
        self.loss_kind = None  # loss_logits() of a loss seen lately: its class count (torch.loss)
        # on measured steps, the graphs backpropagated so far (their grad_fn, held until the boundary) and how
        # many backward calls went through one of them again (torch.checks backward_once)
        self.graphs: list = []
        self.backwards = 0
        self.repeated = 0
        self.repeated_name = None

    # -- holding values without a device sync ---------------------------------------------------
    def hold(self, value):
        """A float now when that costs no device sync, else a holder (a tuple) for ``pending.read``; None: missing."""
        if type(value) is float or value is None:
            return value
        torch = self.torch
        if isinstance(value, torch.Tensor):
            if is_sharded(value):  # clip_grad_norm_'s total under FSDP2: reading the DTensor would be a collective
                self.sharded = True
                value = local(value)
            if not value.is_cuda:
                if value.is_cpu:
                    return float(value.item())  # nothing to wait for (a non-scalar raises: recorded, missing)
                return (value.detach(), None)  # another accelerator (MPS, XLA): read later, not in this step
            if value.numel() != 1:
                return None
            value = value.detach()
            try:
                return copy_off(torch, value.reshape(()))
            except Exception as exc:
                record_error("torch steps: copying a device scalar", exc)
                return None
        try:
            return float(value)
        except (TypeError, ValueError):
            return None

    # -- the loss ----------------------------------------------------------------------------------
    def on_step_start(self, closure) -> None:
        """The step pre-hook, on a step given a closure (or after one that raised): whether it evaluates one."""
        self.closure_step = closure is not None
        self._closure_taken = False
        self.closures |= self.closure_step

    def saw_backward(self, tensors, grad_tensors) -> None:
        """A ``torch.autograd.backward`` call (the wrapper's, before the backward runs, but for an unmeasured step's
        plain CPU scalar): its scalar is part of the step's loss, a CPU one read at once, any other detached (the
        graph is not kept alive) for ``hold`` at the boundary; a DTensor's too (its ``item`` would be a collective)."""
        t = tensors
        Tensor = self.Tensor
        if type(t) is not Tensor:
            if type(t) in (list, tuple):
                if len(t) != 1:
                    return
                t = t[0]
            if not isinstance(t, Tensor):
                return
        if grad_tensors is not None and not (
            type(grad_tensors) in (list, tuple) and all(g is None for g in grad_tensors)
        ):
            return  # a vector backward with explicit gradients is not a loss
        if self.closure_step:
            if self._closure_taken:
                return
            self._closure_taken = True
        graph = t  # the graph is read through GradScaler's multiply; the value is the loss's own
        scaled = self._scaled
        if scaled is not None and scaled[0]() is t:
            t = scaled[1]
            self._scaled = None
        if self.wanted:
            self._note_graph(graph)
            sig = signals.signals()  # torch.batches: the targets of the step's loss
            if sig is not None:
                sig.on_loss(graph)
        looks = self._loss_looks
        self._loss_looks = looks + 1
        if not looks % _LOSS_LOOK_EVERY or (self.wanted and self.backwards == 1):  # and a measured step's first
            try:
                self.loss_kind = loss_logits(graph)
            except Exception as exc:
                record_error("torch steps: the loss's logits", exc)
        if type(t) is Tensor and t.is_cpu:
            try:
                value = t.item()
            except RuntimeError:  # not a scalar: torch's backward, given no gradient, refuses it too
                return
        elif t.numel() != 1:  # not a scalar (read before anything of it is kept)
            return
        else:
            value = t.detach()
        self.losses.append(value)

    def _note_graph(self, t) -> None:
        """A measured step's backward calls: one more, and whether its loss's graph was backpropagated before."""
        self.backwards += 1
        fn = t.grad_fn
        if fn is None:
            return
        for seen in self.graphs:
            if seen is fn:
                self.repeated += 1
                self.repeated_name = type(fn).__name__
                return
        if len(self.graphs) < 8:
            self.graphs.append(fn)

    def take_backwards(self) -> tuple:
        """``(backward calls, repeats on one graph, the repeated graph's node name)`` since the last call; forgets
        them."""
        out = (self.backwards, self.repeated, self.repeated_name if self.repeated else None)
        self.graphs = []
        self.backwards = self.repeated = 0
        return out

    def step_loss(self, frame, loss=None, measured: bool = False):
        """Every step's loss, for the boundary: ``probe.step(loss=)``'s (``loss``), else the backpropagated
        scalars, else (on a ``measured`` step: it walks frames) the loop's ``loss`` variable. A float, a
        holder or None; a failure is recorded and gives None."""
        try:
            if loss is not None:
                self.forget()  # probe.step(loss=) overrides what was backpropagated
                return self.hold(loss)
            if self.losses:
                return self.take()
            if measured:
                return self.hold(self.find_loss(frame))
        except Exception as exc:
            self.forget()
            record_error("torch steps: loss", exc)
        return None

    def total(self, losses: list):
        """The sum of a step's noted losses (``saw_backward``'s floats and detached tensors): a float when all
        were read at once, else a tensor (the floats added as a scalar: no copy to the device)."""
        floats = [x for x in losses if type(x) is float]
        if len(floats) == len(losses):
            return sum(floats)
        tensors = [x for x in losses if type(x) is not float]
        if len(tensors) == 1:
            t = tensors[0]
        else:
            try:
                first = tensors[0]
                t = self.torch.stack([x.reshape(()).to(first.device, first.dtype) for x in tensors]).sum()
            except Exception as exc:
                record_error("torch steps: summing the step's losses", exc)
                return tensors[-1]
        return t + sum(floats) if floats else t

    def take(self):
        """This step's backpropagated loss for its row: a float, a holder (``hold``) or None. Runs on every step."""
        losses = self.losses
        if not losses:
            return None
        v = losses[0] if len(losses) == 1 else self.total(list(losses))
        losses.clear()
        return v if type(v) is float else self.hold(v)

    def forget(self) -> None:
        """Drop what was noted for the step (``probe.step(loss=)`` gave the loss, or the probe pauses)."""
        self.losses.clear()
        self._scaled = None

    def find_loss(self, frame):
        f, n = frame, 0
        while f is not None and n < 3:
            loc = f.f_locals
            try:
                for name in self.loss_names:
                    v = loc.get(name)
                    if v is None:
                        continue
                    if is_a(v, self.torch.Tensor):  # by type: a local's __class__ property is the job's code
                        if v.numel() == 1:  # not a per-sample loss vector: look further out for the scalar
                            return v
                    elif is_a(v, (float, int)):
                        return v
            finally:
                release(f, loc, own=True)  # else 3.11/3.12's cached snapshot keeps last step's tensors alive
            f, n = f.f_back, n + 1
        return None

    # -- the gradient norm ----------------------------------------------------------------------------
    def measured_norm(self, optimizer, budget, now_ns: int, forced: bool = False):
        """The optional grad norm of a measured step: ``clip_grad_norm_``'s when the loop clipped, else the
        probe's own when ``budget`` (PROBE_GRAD_NORM, charged its time) allows it or ``forced``. A float, a
        holder or None; a failure is recorded and gives None."""
        clipped, self.clip_norm = self.clip_norm, None
        try:
            if clipped is not None:
                return self.hold(clipped)
            if budget.allows(now_ns) or forced:
                t0 = time.perf_counter_ns()
                norm = self.hold(self.grad_norm(optimizer))
                budget.spend(time.perf_counter_ns() - t0)
                return norm
        except Exception as exc:
            record_error("torch steps: grad norm", exc)
        return None

    def grad_norm(self, optimizer):
        """The total L2 norm of ``optimizer``'s gradients, as a tensor on their device (None: none to measure).
        Sharded gradients (FSDP2's DTensors) count by their local shards, without a collective (``sharded`` says
        so): the model's norm is the root of the sum over ranks of their squares, which a client can combine."""
        if optimizer is None or id(optimizer) in self._norm_failed:
            return None
        torch = self.torch
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return None
        if any(is_sharded(g) for g in grads):
            self.sharded = True
            grads = [local(g) for g in grads]
            grads = [g for g in grads if g.numel()] or [grads[0]]  # a rank may hold an empty shard
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

    # -- wrapping torch ------------------------------------------------------------------------------
    def wrap(self) -> None:
        for what, fn in (("clip_grad_norm_", self._wrap_clip), ("torch.autograd.backward", self._wrap_backward)):
            try:
                fn()
            except Exception as exc:
                record_error(f"torch steps: wrapping {what}", exc)
        self.note(self.wanted)

    def note(self, on: bool) -> None:
        """Whether the next step is measured (the optional values: ``clip_grad_norm_``'s norm is kept
        on those, so its wrapper is in for those steps only: a call through it is paid on every step it is
        in). The loss wrappers stay in on every step: the loss is a core signal."""
        self.wanted = on
        clip = self._clip
        if clip is not None:
            utils = self.torch.nn.utils
            now = utils.clip_grad_norm_
            if on and now is clip._probe_original:
                utils.clip_grad_norm_ = clip
            elif not on and now is clip:  # never over another library's wrapper put in since
                utils.clip_grad_norm_ = clip._probe_original

    def unwrap(self) -> None:
        utils = self.torch.nn.utils
        original = getattr(utils.clip_grad_norm_, "_probe_original", None)
        if original is not None:
            utils.clip_grad_norm_ = original
        self._clip = None
        autograd = self.torch.autograd
        original = getattr(autograd.backward, "_probe_original", None)
        if original is not None:
            autograd.backward = original
        scaler = getattr(getattr(self.torch, "amp", None), "GradScaler", None)
        for name in ("scale", "step"):
            original = getattr(getattr(scaler, name, None), "_probe_original", None)
            if original is not None:
                setattr(scaler, name, original)
        self.forget()

    def _wrap_clip(self) -> None:
        """Keep the total norm that torch.nn.utils.clip_grad_norm_ computes anyway (the norm before clipping);
        ``note`` puts the wrapper in for measured steps."""
        utils = self.torch.nn.utils
        original = utils.clip_grad_norm_
        if getattr(original, "_probe_original", None) is not None:
            return
        capture = self

        @functools.wraps(original)
        def clip_grad_norm_(*args, **kwargs):
            total = original(*args, **kwargs)
            if capture.wanted:  # a measured step's: an unmeasured one's would go stale
                sig = signals.signals()  # unscaled when a GradScaler had not unscaled the gradients (torch.scaler)
                max_norm = args[1] if len(args) > 1 else kwargs.get("max_norm")
                capture.clip_norm = total if sig is None else sig.on_clip(total, max_norm)
            return total

        clip_grad_norm_._probe_original = original
        self._clip = clip_grad_norm_

    def _wrap_backward(self) -> None:
        """See every ``torch.autograd.backward`` call (``Tensor.backward`` goes through it) and
        GradScaler's ``scale`` (so a scaled loss counts unscaled)."""
        autograd = self.torch.autograd
        original = autograd.backward
        capture, Tensor = self, self.torch.Tensor
        if getattr(original, "_probe_original", None) is None:

            @functools.wraps(original)
            def backward(tensors, grad_tensors=None, *args, **kwargs):
                try:  # ``saw_backward``'s common case inline: a plain CPU scalar, nothing else to note
                    looks = capture._loss_looks
                    if (
                        type(tensors) is Tensor
                        and grad_tensors is None
                        and looks % _LOSS_LOOK_EVERY
                        and not (capture.wanted or capture.closure_step or capture._scaled)
                        and tensors.is_cpu
                    ):
                        capture._loss_looks = looks + 1
                        capture.losses.append(tensors.item())
                    else:
                        capture.saw_backward(tensors, grad_tensors)
                except RuntimeError:  # not a scalar (``item``): torch's backward, given no gradient, refuses it too
                    pass
                except Exception as exc:
                    record_error("torch steps: noting the loss", exc)
                return original(tensors, grad_tensors, *args, **kwargs)

            backward._probe_original = original
            autograd.backward = backward
        scaler = getattr(getattr(self.torch, "amp", None), "GradScaler", None)
        scale = getattr(scaler, "scale", None)
        if scale is not None and getattr(scale, "_probe_original", None) is None:

            @functools.wraps(scale)
            def scale_(self_, outputs):
                out = scale(self_, outputs)
                if capture.wanted:  # torch.scaler: the scaler of a measured step's loss
                    sig = signals.signals()
                    if sig is not None:
                        sig.on_scale(self_)
                if out is not outputs and isinstance(outputs, Tensor):
                    try:
                        capture._scaled = (weakref.ref(out), outputs.detach())
                    except TypeError:
                        pass
                return out

            scale_._probe_original = scale
            scaler.scale = scale_
        step = getattr(scaler, "step", None)
        if step is not None and getattr(step, "_probe_original", None) is None:

            @functools.wraps(step)
            def step_(self_, optimizer, *args, **kwargs):
                had = bool(capture.losses)
                out = step(self_, optimizer, *args, **kwargs)
                if had and capture.losses and capture.ends_step is not None and capture.ends_step():
                    capture.losses.clear()  # skipped (inf or NaN gradients): no optimizer step, so no step's loss
                return out

            step_._probe_original = step
            scaler.step = step_
