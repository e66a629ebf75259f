"""What goes into each training step: micro-batches, samples and tokens, counted at the primary model's forward.

The primary model is the root model holding the lead optimizer's parameters (else the first
model found). Two forward pre-hooks sit on that one module, never a global hook:

* the counting hook, on the steps the budget measures only (a module hook costs every forward
  call, and the counts are optional values): each training forward call with a batch is one
  micro-batch, its first dimension the samples, and an integer batch of two or more
  dimensions is token ids (features are floating point), counted as tokens;
* the first-forward hook, on every step: when the step's first forward call began, which the
  step tracker turns into ``data_wait`` (``first_forward`` is the tracker's callback).

Evaluation passes (no grad) are not micro-batches. ``take`` hands the step's counts to the
boundary and starts the next step's.
"""

from __future__ import annotations

import weakref

from ..util.errorlog import record_error
from ..util.objects import is_a
from . import finder, signals

__all__ = ["InputCounter"]

_TOKEN_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")


class InputCounter:
    """Counts of the current step's inputs (``micro_batches``, ``samples``, ``tokens``) at the primary model."""

    def __init__(self, torch, first_forward):
        self.torch = torch
        self.first_forward = first_forward  # called by the every-step hook (the tracker's data_wait clock)
        self.samples = 0.0
        self.tokens = 0.0
        self.micro_batches = 0
        self.root = None  # weakref to the primary model
        self.counting = None  # the counting hook's handle, present on measured steps only
        self._first = None  # the first-forward hook's handle
        self._token_dtypes = {getattr(torch, n) for n in _TOKEN_DTYPES if hasattr(torch, n)}

    def pre_hook(self, module, args, kwargs):
        """The counting hook: one training forward call of the primary model."""
        torch = self.torch
        if not torch.is_grad_enabled():
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
            self._first = model.register_forward_pre_hook(self.first_forward)
        except Exception as exc:
            record_error("torch steps: root model hook", exc)
            self.root = None
            return
        self.count(counting)

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
        """Take both hooks out (the probe pauses, or the primary model changes)."""
        try:
            self.count(False)
        except Exception:
            self.counting = None
        handle, self._first = self._first, None
        if handle is not None:
            try:
                handle.remove()
            except Exception:
                pass
