"""What the guard keeps, reads and writes: host copies of batches and state, the values a decision reads, the
evidence bundle of a caught step, and ``probe.load_evidence`` to replay it.

A bundle is one ``torch.save`` file, ``DIR/guard-step<STEP>-rank<RANK>.pt``, written with probe's safe writer
(``probe.util.files.write_file``) into the directory the user named; docs/guard.md ("Evidence") lists what it
holds. ``load_evidence(path)`` takes a bundle file, or a directory (its newest bundle), and returns an
``Evidence``; ``Evidence.replay(model)`` loads the weights into ``model`` and runs the offending step's forward
calls with forward hooks, naming the first module whose output is not finite.
"""

from __future__ import annotations

import math
import os
import re

from .._errors import ActionError, ProbeError
from ..training.frameworks import local
from ..util import files


_NAME = re.compile(r"^guard-step(\d+)-rank(\d+)\.pt$")


def bundle_name(step: int, rank: int | None) -> str:
    return f"guard-step{int(step):08d}-rank{int(rank or 0)}.pt"


def write_evidence(directory: str, bundle: dict) -> str:
    """Write ``bundle`` as a new file in ``directory`` (created if missing, mode 0700); return its path."""
    import torch

    directory = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ActionError(
            f"cannot create {directory} ({exc.strerror or exc}); name another evidence directory."
        ) from None
    path = os.path.join(directory, bundle_name(bundle["step"], bundle.get("rank")))
    files.write_file(path, lambda f: torch.save(bundle, f), replace=True, error=ActionError)
    return path


class Replay:
    """What a replay found: ``first_nonfinite`` (the dotted name of the first module whose output held a NaN or an
    infinity, ``""`` for the model itself, None if every output was finite), ``outputs`` (each forward call's
    output) and ``finite`` (whether every output was finite)."""

    def __init__(self, first_nonfinite, outputs):
        self.first_nonfinite = first_nonfinite
        self.outputs = outputs
        self.finite = first_nonfinite is None

    def __repr__(self) -> str:
        return f"Replay(first_nonfinite={self.first_nonfinite!r}, calls={len(self.outputs)})"


class Evidence:
    """One loaded bundle (see the module's docstring); its keys are attributes too (``ev.loss``, ``ev.batches``)."""

    def __init__(self, path: str, data: dict):
        self.path = path
        self.data = data

    def __getattr__(self, name):
        try:
            return self.__dict__["data"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"Evidence(step={self.data.get('step')}, reason={self.data.get('reason')!r}, path={self.path!r})"

    @property
    def batch(self):
        """The offending step's forward calls: a list of ``(args, kwargs)``."""
        batches = self.data.get("batches") or []
        return batches[-1]["calls"] if batches else []

    def replay(self, model, *, load_state: bool = True) -> Replay:
        """Run the offending step's forward calls on ``model`` (its weights set to the bundle's first, unless
        ``load_state=False``) under ``torch.no_grad``, with forward hooks on every module; return what was found."""
        import torch

        if load_state and self.data.get("model") is not None:
            model.load_state_dict(self.data["model"])
        if not self.batch:
            raise ProbeError(
                f"{self.path} holds no batch (the guard was armed with --keep 0); arm it with --keep 1 or more."
            )
        return Replay(*run_forward(torch, model, self.batch))


def run_forward(torch, model, calls) -> tuple:
    """``(first module whose output is not finite, outputs)``: ``calls`` run on ``model`` under ``torch.no_grad``
    with a forward hook on every module (``""`` names the model itself; None: every output was finite)."""
    first: list = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module, args, output):
        if not first and not _finite(torch, output):
            first.append(names.get(module, type(module).__name__))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    outputs = []
    try:
        with torch.no_grad():
            for args, kwargs in calls:
                outputs.append(model(*args, **kwargs))
    finally:
        for h in handles:
            h.remove()
    return (first[0] if first else None), outputs


def first_nonfinite(torch, model, calls) -> str | None:
    """In the training process, at a caught step: the step's forward calls run again on the model as it is (on the
    device its parameters are on), its buffers (batch-norm statistics) and the random generators put back after,
    so that training goes on as if it had not run. Not on several ranks, where a forward may issue a collective."""
    model = getattr(model, "module", model)  # DDP's own forward would synchronise buffers across ranks
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    kept = [(b, b.detach().clone()) for b in model.buffers()]
    moved = [host_copy(torch, call, device=device)[0] for call in calls]
    cuda = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            return run_forward(torch, model, moved)[0]
    finally:
        with torch.no_grad():
            for b, copy in kept:
                b.copy_(copy)


def _finite(torch, value) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, (list, tuple)):
        return all(_finite(torch, v) for v in value)
    if isinstance(value, dict):
        return all(_finite(torch, v) for v in value.values())
    if isinstance(value, float):
        return math.isfinite(value)
    values = getattr(value, "values", None)  # a ModelOutput
    if callable(values):
        try:
            return all(_finite(torch, v) for v in values())
        except Exception:
            return True
    return True


def load_evidence(path: str) -> Evidence:
    """Load a guard evidence bundle: the file, or the newest bundle in a directory. Only a file of this user's
    (or root's) is read."""
    import torch

    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if _NAME.match(n))
        if not names:
            raise ProbeError(f"{path} holds no guard evidence (guard-step*-rank*.pt); give a bundle's path.")
        path = os.path.join(path, names[-1])
    try:
        with files.open_own(path, what="evidence bundle") as f:
            data = torch.load(f, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise ProbeError(f"cannot read {path} ({exc.strerror or exc}); give a bundle's path.") from None
    if not isinstance(data, dict) or "reason" not in data:
        raise ProbeError(f"{path} is not a guard evidence bundle.")
    return Evidence(path, data)


# -- what the guard keeps: host copies ------------------------------------------------------------------------
def bytes_of(torch, obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(bytes_of(torch, v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(bytes_of(torch, v) for v in obj)
    return 0


def host_copy(torch, obj, depth: int = 0, device="cpu"):
    """``(copy, bytes)``: tensors detached and copied to the host (or ``device``), lists, tuples and dicts (a
    BatchEncoding as a plain dict) copied through, numbers, strings and None kept, anything else as its type's name."""
    if isinstance(obj, torch.Tensor):
        t = local(obj).detach().to(device, copy=True)
        return t, t.numel() * t.element_size()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj, 0
    if depth < 8 and isinstance(obj, (list, tuple)):
        items = [host_copy(torch, v, depth + 1, device) for v in obj]
        return type(obj)(v for v, _ in items) if type(obj) in (list, tuple) else [v for v, _ in items], sum(
            n for _, n in items
        )
    if depth < 8 and isinstance(obj, dict):
        items = {str(k): host_copy(torch, v, depth + 1, device) for k, v in obj.items()}
        return {k: v for k, (v, _) in items.items()}, sum(n for _, n in items.values())
    return f"<{type(obj).__name__}>", 0


def copy_state(torch, optimizer, params, model) -> tuple:
    """The weights, the optimizer's state for them and the model's buffers, copied to the host (``restore_state``
    puts them back, bit for bit)."""
    state = optimizer.state
    weights = [(p, host_copy(torch, p)[0]) for p in params]
    states = {
        p: {k: (host_copy(torch, v)[0], getattr(v, "device", None)) for k, v in state[p].items()}
        for p in params
        if p in state
    }
    buffers = [(b, b.detach().to("cpu", copy=True)) for b in model.buffers()] if model is not None else []
    return weights, states, buffers


def restore_state(torch, optimizer, kept: tuple) -> None:
    weights, states, buffers = kept
    with torch.no_grad():
        for p, copy in weights:
            local(p).copy_(copy)
        for b, copy in buffers:
            b.copy_(copy)
    for p, _ in weights:
        if p in states:
            optimizer.state[p] = {
                k: (v.to(dev, copy=True) if dev is not None else v) for k, (v, dev) in states[p].items()
            }
        else:
            optimizer.state.pop(p, None)


def bundle(torch, optimizer, model, batches, **facts) -> dict:
    """The evidence of a caught step, before its update (see the module's docstring): ``facts`` (its step, rank,
    reason, loss, grad_norm, median, first_nonfinite, model_name) and what is read here."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    grad_norms = {}
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if p.grad is not None:
                grad_norms[names.get(id(p), f"group{i}.param{j}")] = float(local(p.grad).float().norm())
    return {
        **facts,
        "loss": math.nan if facts.get("loss") is None else float(facts["loss"]),
        "batches": [{"step": b["step"], "calls": b["calls"]} for b in batches],
        "model": host_copy(torch, model.state_dict())[0] if model is not None else None,
        "model_class": type(model).__name__ if model is not None else None,
        "optimizer": host_copy(torch, optimizer.state_dict())[0],
        "optimizer_class": type(optimizer).__name__,
        "lr": [float(g["lr"]) for g in optimizer.param_groups if isinstance(g.get("lr"), (int, float))],
        "grad_norms": grad_norms,
    }


def _available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def keep_cost(torch, optimizers, model, keep: int, rollback: bool, batch_cap: int) -> dict:
    """The host memory the guard holds: the last ``keep`` steps' batches, up to ``batch_cap`` bytes, and with
    ``rollback`` the copy of the weights, optimizer state and buffers; ActionError when that would take more than
    half the memory available now. Read on the server thread: the optimizer's state is looked up, never iterated."""
    state = 0
    if rollback:
        for opt in optimizers:
            for g in list(opt.param_groups):
                for p in list(g["params"]):
                    state += bytes_of(torch, p) + bytes_of(torch, dict(opt.state.get(p) or {}))
        if model is not None:
            state += bytes_of(torch, list(model.buffers()))
    batches = batch_cap if keep else 0
    avail = _available()
    if avail is not None and state + batches > avail // 2:
        raise ActionError(
            f"the guard would hold up to {(state + batches) / 2**20:.0f} MiB on the host (the copy of the weights and "
            f"optimizer state for --rollback, {state / 2**20:.0f} MiB, and the batches of --keep {keep}, at most "
            f"{batches / 2**20:.0f} MiB), more than half the {avail / 2**20:.0f} MiB available; arm it without "
            "--rollback, or with --keep 0."
        )
    return {"state_bytes": state, "batch_bytes_max": batches, "available": avail}


# -- the values a decision reads ------------------------------------------------------------------------------
def grad_norm(torch, grads) -> float:
    """The total norm of ``grads`` (this rank's shards of DTensors), read on the host: a sync on a device."""
    by_device: dict = {}
    for g in grads:
        g = local(g)
        by_device.setdefault(g.device, []).append(g)
    total = 0.0
    for gs in by_device.values():
        total += float(torch.stack([n.float() for n in torch._foreach_norm(gs)]).pow(2).sum())
    return math.sqrt(total)


def step_loss(tracker, closure_result) -> float | None:
    """The step's loss: what the step tracker noted being backpropagated, else the closure's result."""
    losses = tracker.capture.losses if tracker is not None else []
    try:
        if losses:
            return float(sum(float(x) for x in losses))
        if closure_result is not None and getattr(closure_result, "numel", lambda: 0)() == 1:
            return float(closure_result)
    except Exception:
        pass
    return None


def finite(torch, params) -> bool:
    with torch.no_grad():
        return all(bool(torch.isfinite(local(p)).all()) for p in params)


def median(values, least: int) -> float | None:
    """The median of ``values``, or None with fewer than ``least`` of them."""
    if len(values) < least:
        return None
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
