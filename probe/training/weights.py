"""What the optimizer steps do to the weights, watched on a fixed sample of their elements on their device and
read once the host copy has landed (no device sync, no collective). Nothing here raises into the training loop.

* ``Updates`` (``torch.checks``, called by ``invariants`` on measured steps): ``params_move``, a sample of the
  trainable tensors an optimizer holds whose plain update (lr x grad) is well above the float's resolution
  changed since the last measured step (else the optimizer never steps or skips the update); ``frozen_still``,
  a sample of the frozen tensors an optimizer holds did not change (momentum or weight decay on a stale zero
  gradient moves them).
* ``Replicas`` (``torch.weight_sums``, ``torch.ddp``; docs/ranks.md): a checksum of each DDP replica's weights,
  the sample summed with fixed weights in float64, with the number of collectives the group has issued by then,
  taken at each multiple of ``every`` (a power of two, doubled while a checksum costs over ``_SHARE`` of the
  steps it covers) so that ranks meet; and each DDP model's configuration.
"""

from __future__ import annotations

import math
import time
import weakref

from . import finder
from ..util.errorlog import record_error
from ..util.ring import Ring
from ..util.ring import copy_off


# collectives: a count, NULL (None) where the process group cannot say
SUM_COLUMNS = dict(
    step="i8", time="f8", model="O", position="i8", name="O", numel="i8", checksum="f8", collectives="f8"
)
DDP_COLUMNS = {
    "model": "O",
    "world_size": "i8",
    "broadcast_buffers": "b1",
    "find_unused_parameters": "b1",
    "static_graph": "b1",
    "iteration": "i8",
    "unused_parameter_size": "i8",
    "unused_seen": "i8",
    "norm_modules": "O",
    "every": "i8",
    "tensors": "i8",
}
_SAMPLE = 64  # elements of each tensor in its checksum
_EVERY_MIN = 16  # steps between checksums at least (a power of two)
_EVERY_MAX = 4096
_SHARE = 0.002  # share of the covered steps' time one checksum may take before the cadence halves
_ROWS = 16384  # torch.weight_sums ring rows: 256 checksums of a 64-tensor model
_REFRESH_MAX = 500  # steps between refreshes of the DDP models at most (they double from step 1 until then)
_PENDING_MAX = 8  # device copies waiting for their event at most


class _Model:
    """One DDP-wrapped model: its tensors' sample plan, built once per refresh."""

    __slots__ = ("label", "ddp", "names", "params", "numels", "plans", "config", "unused_seen")

    def __init__(self, label, ddp):
        self.label = label
        self.ddp = weakref.ref(ddp)
        self.names: list = []
        self.params: list = []  # weakrefs, in named_parameters order
        self.numels: list = []
        self.plans: dict = {}  # device -> (positions, segment ids, weights)
        self.config: dict = {}
        self.unused_seen = 0


class Replicas:
    def __init__(self, torch):
        self.torch = torch
        self.sums = Ring(SUM_COLUMNS, _ROWS)
        self.due = math.inf  # the next step whose boundary takes a checksum (steps.py keeps it off the quick path)
        self.every = _EVERY_MIN
        self._refresh_at = 1
        self._models: list[_Model] = []
        self._pending: list = []  # (step, time, model, (positions, names, numels), issued, host tensor, event)

    @property
    def next_step(self) -> float:
        """The next step whose full boundary calls :meth:`at_boundary` (a refresh of the models or a checksum)."""
        return min(self._refresh_at, self.due)

    # -- the one call from the step boundary ----------------------------------------------------------------
    def at_boundary(self, step: int, step_s: float | None) -> None:
        """At the full step boundary of ``next_step`` and after: refresh the DDP models now and then, read landed device
        copies, and take a checksum when ``step`` is due."""
        try:
            if step >= self._refresh_at:
                self._refresh_at = step + min(step, _REFRESH_MAX)
                self._refresh()
            if self._pending:
                self._resolve()
            if not self._models:
                self.due = math.inf
                return
            if step >= self.due and step % self.every == 0:
                t0 = time.perf_counter()
                for m in self._models:
                    self._checksum(step, m)
                cost = time.perf_counter() - t0
                if step_s and cost > _SHARE * step_s * self.every and self.every < _EVERY_MAX:
                    self.every *= 2
            self.due = (step // self.every + 1) * self.every
        except Exception as exc:
            record_error("torch weight sums", exc)
            self.due = math.inf if not self._models else (step // self.every + 1) * self.every

    # -- the DDP models -----------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        torch = self.torch
        dist = getattr(torch, "distributed", None)
        if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            self._models = []
            return
        ddp_type = torch.nn.parallel.DistributedDataParallel
        known = {id(m.ddp()): m for m in self._models if m.ddp() is not None}
        models = []
        for found in finder.models():
            obj = found.obj
            if not isinstance(obj, ddp_type):
                continue
            m = known.get(id(obj)) or self._plan(found.name, obj)
            if m is not None:
                self._configure(m, obj, dist.get_world_size())
                models.append(m)
        self._models = models

    def _plan(self, label: str, ddp) -> _Model | None:
        torch = self.torch
        m = _Model(label, ddp)
        by_device: dict = {}
        for name, p in ddp.module.named_parameters():
            if type(p) is not torch.nn.Parameter and hasattr(p, "to_local"):
                continue  # a DTensor: its shards differ by design
            n = p.numel()
            if n == 0:
                continue
            k = min(n, _SAMPLE)
            stride = n // k
            i = len(m.names)
            m.names.append(finder.module_path(name))
            m.params.append(weakref.ref(p))
            m.numels.append(n)
            by_device.setdefault(p.device, []).append((i, k, stride))
        if not m.names:
            return None
        for device, entries in by_device.items():
            ks = [k for _, k, _ in entries]
            seg = torch.repeat_interleave(torch.arange(len(entries)), torch.tensor(ks))
            gen = torch.Generator().manual_seed(len(entries))  # fixed weights, the same on every rank
            w = 1.0 + torch.rand(int(sum(ks)), generator=gen, dtype=torch.float64)
            meta = (
                [i for i, _, _ in entries],
                [m.names[i] for i, _, _ in entries],
                [m.numels[i] for i, _, _ in entries],
            )
            m.plans[device] = (entries, seg.to(device), w.to(device), meta)
        return m

    def _configure(self, m: _Model, ddp, world: int) -> None:
        """DDP's own settings and its logger's last sample (read here, on the training thread)."""
        torch = self.torch
        data = {}
        try:
            data = ddp._get_ddp_logging_data()
        except Exception:
            pass
        unused = int(data.get("unused_parameter_size", 0) or 0)
        m.unused_seen = max(m.unused_seen, unused)
        bn = torch.nn.modules.batchnorm._BatchNorm
        norms = [
            finder.module_path(n)
            for n, mod in ddp.module.named_modules()
            if isinstance(mod, bn) and not isinstance(mod, torch.nn.SyncBatchNorm) and mod.track_running_stats
        ]
        m.config = {
            "world_size": world,
            "broadcast_buffers": bool(getattr(ddp, "broadcast_buffers", True)),
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "static_graph": bool(getattr(ddp, "static_graph", False)),
            "iteration": int(data.get("iteration", 0) or 0),
            "unused_parameter_size": unused,
            "norm_modules": ", ".join(norms) or None,
        }

    # -- the checksum -------------------------------------------------------------------------------------------
    def _checksum(self, step: int, m: _Model) -> None:
        torch = self.torch
        now = time.time()
        issued = _issued(m.ddp(), m.config.get("world_size", 0))
        with torch.no_grad():
            for device, (entries, seg, w, meta) in m.plans.items():
                parts = []
                for i, k, stride in entries:
                    p = m.params[i]()
                    if p is None:
                        return  # the model was rebuilt: the next refresh plans it again
                    flat = p.detach().reshape(-1)
                    parts.append(flat[stride // 2 :: stride][:k] if stride > 1 else flat)
                vals = torch.cat(parts).to(torch.float64)
                sums = torch.zeros(len(entries), dtype=torch.float64, device=device).index_add_(0, seg, vals * w)
                if sums.is_cuda:
                    if len(self._pending) >= _PENDING_MAX:
                        continue
                    self._pending.append((step, now, m.label, meta, issued, *copy_off(torch, sums)))
                else:
                    self._store(step, now, m.label, meta, issued, sums.tolist())

    def _store(self, step, now, label, meta, issued, values) -> None:
        for pos, name, n, v in zip(*meta, values):
            self.sums.append(step, now, label, pos, name, n, v, issued)

    def _resolve(self) -> None:
        keep = []
        for item in self._pending:
            if item[-1].query():
                self._store(*item[:5], item[5].tolist())
            else:
                keep.append(item)
        self._pending = keep

    # -- the tables ---------------------------------------------------------------------------------------------
    def snapshot_sums(self) -> dict:
        try:
            if self._pending:
                self._resolve()
        except Exception as exc:
            record_error("torch weight sums: resolve", exc)
        return self.sums.snapshot()

    def snapshot_ddp(self) -> dict:
        cols: dict = {name: [] for name in DDP_COLUMNS}
        for m in list(self._models):
            row = dict(m.config, model=m.label, unused_seen=m.unused_seen, every=self.every, tensors=len(m.names))
            for key, col in cols.items():
                col.append(row.get(key))
        return cols


def _issued(ddp, world: int) -> int | None:
    """How many collectives DDP's process group has issued on this rank (its sequence number), the same on every
    rank while they run the same collectives; None where the group cannot say or is smaller than the job (the
    ranks of other groups run other collectives, and the doctor compares every rank's count)."""
    try:
        group = ddp.process_group
        if group.size() != world:
            return None
        return int(group._get_sequence_number_for_group())
    except Exception:  # no model (rebuilt), a group without sequence numbers, an older torch
        return None


_instance: list = []


def replicas(torch=None) -> Replicas | None:
    """The process's Replicas (made on the first call that passes torch), or None before that."""
    if not _instance and torch is not None:
        _instance.append(Replicas(torch))
    return _instance[0] if _instance else None


# -- what the steps changed (torch.checks) ----------------------------------------------------------------------------
_WATCHED = 12  # tensors of each kind (trainable, frozen) Updates watches
_ELEMENTS = 16  # elements read of each
_NAMES_SHOWN = 5
_RESOLUTION = 1e-5  # an update smaller than this fraction of the value may round away (float32's is ~1e-7)


def grouped(hit: list, every: list) -> str:
    """``hit`` (dotted tensor names) under the largest module prefixes of ``every`` that hold only hit ones.

    >>> grouped(["enc.0.weight", "enc.0.bias", "enc.1.weight"],
    ...         ["enc.0.weight", "enc.0.bias", "enc.1.weight", "head.weight"])
    'enc.* (3 tensors)'
    >>> grouped(["enc.0.weight", "head.weight"], ["enc.0.weight", "enc.0.bias", "head.weight"])
    'enc.0.weight, head.weight'
    """
    hit_set = set(hit)
    count: dict = {}
    pure: dict = {}
    for name in every:
        parts = name.split(".")
        for k in range(1, len(parts)):
            prefix = ".".join(parts[:k])
            count[prefix] = count.get(prefix, 0) + 1
            pure[prefix] = pure.get(prefix, True) and name in hit_set
    labels, seen = [], set()
    for name in hit:
        parts = name.split(".")
        label = name
        for k in range(1, len(parts)):  # the largest pure prefix holding more than this one tensor
            prefix = ".".join(parts[:k])
            if pure.get(prefix) and count[prefix] > 1:
                label = f"{prefix}.* ({count[prefix]} tensors)"
                break
        if label not in seen:
            seen.add(label)
            labels.append(label)
    shown = ", ".join(labels[:_NAMES_SHOWN])
    return shown + (f" and {len(labels) - _NAMES_SHOWN} more" if len(labels) > _NAMES_SHOWN else "")


class _Watched:
    __slots__ = ("name", "param", "opt", "group", "idx", "prev", "pending")

    def __init__(self, name, param, opt, group, idx):
        self.name, self.param, self.opt, self.group, self.idx = name, weakref.ref(param), weakref.ref(opt), group, idx
        self.prev = None  # the sampled elements at the last measured step
        self.pending = None


def _spread(items: list, n: int) -> list:
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


class Updates:
    def __init__(self, torch):
        self.torch = torch
        self._trainable: list = []
        self._frozen: list = []
        self._every: list = []
        self._pending = None  # (host flags, event, step) of a device verdict not read yet

    # -- targets -------------------------------------------------------------------------------------------------
    def refresh(self, model, optimizer) -> None:
        """Pick the tensors to watch in ``model`` (those an optimizer found holds) and the scheduler of
        ``optimizer``."""
        torch = self.torch
        held: dict = {}
        for f in finder.optimizers():
            inner, _ = finder.unwrap_optimizer(f.obj)
            for gi, group in enumerate(inner.param_groups):
                for p in group["params"]:
                    held[id(p)] = (inner, gi)
        named = [(finder.module_path(n), p) for n, p in model.named_parameters()]
        self._every = [n for n, _ in named]
        old = {w.name: w for w in self._trainable + self._frozen}
        trainable, frozen = [], []
        for name, p in named:
            if id(p) not in held or not p.is_floating_point() or p.numel() == 0 or type(p.data) is not torch.Tensor:
                continue  # a DTensor or another subclass: reading it could be a collective
            (trainable if p.requires_grad else frozen).append((name, p))
        out = []
        for kind in (_spread(trainable, _WATCHED), _spread(frozen, _WATCHED)):
            watched = []
            for name, p in kind:
                w = old.get(name)
                if w is not None and w.param() is p:
                    watched.append(w)
                    continue
                n = p.numel()
                idx = torch.linspace(0, n - 1, min(_ELEMENTS, n), device=p.device).long()
                opt, gi = held[id(p)]
                watched.append(_Watched(name, p, opt, gi, idx))
            out.append(watched)
        self._trainable, self._frozen = out

    # -- the checks ------------------------------------------------------------------------------------------------
    def check(self, step: int, now: float, record) -> None:
        try:
            self._motion(step, now, record)
        except Exception as exc:
            record_error("torch checks: parameters move", exc)

    def _lr(self, w) -> float | None:
        opt = w.opt()
        lr = opt.param_groups[w.group].get("lr") if opt is not None else None
        return None if lr is None or getattr(lr, "is_cuda", False) else float(lr)

    def _motion(self, step, now, record) -> None:
        torch = self.torch
        if self._pending is not None:  # a device verdict from the last measured step
            host, ev, items, at = self._pending
            if not ev.query():
                return
            self._pending = None
            self._verdict(at, now, record, items, host.tolist())
        flags, items = [], []
        for w in self._trainable + self._frozen:
            p = w.param()
            if p is None:
                continue
            v = p.detach().reshape(-1).index_select(0, w.idx)
            frozen = not p.requires_grad
            if frozen:
                if w.prev is not None:
                    flags.append(torch.stack([(v != w.prev).any(), torch.ones((), dtype=torch.bool, device=v.device)]))
                    items.append((w, True))
                w.prev = v
                continue
            g = p.grad
            lr = self._lr(w)
            if g is None or g.is_sparse or type(g) is not torch.Tensor or not lr:
                w.prev = v
                continue
            # elements whose update lr * grad is well above the float's resolution at their value (a conv bias under
            # batch norm has a gradient of ~1e-9: its SGD update rounds away, and that is no bug)
            nz = g.detach().reshape(-1).index_select(0, w.idx).abs() * lr > v.abs() * _RESOLUTION
            if w.prev is not None:
                flags.append(torch.stack([((v != w.prev) & nz).any(), nz.any()]))
                items.append((w, False))
            w.prev = v
        if not items:
            return
        dev = next((f.device for f in flags if f.is_cuda), None)
        stacked = torch.stack([f.to(dev) for f in flags]) if dev is not None else torch.stack(flags)
        if stacked.is_cuda:
            self._pending = (*copy_off(torch, stacked), items, step)
            return
        self._verdict(step, now, record, items, stacked.tolist())

    def _verdict(self, step, now, record, items, flags) -> None:
        still, moved, watched_t, watched_f = [], [], 0, 0
        for (w, frozen), (changed, graded) in zip(items, flags):
            if frozen:
                watched_f += 1
                if changed:
                    moved.append(w.name)
            elif graded:
                watched_t += 1
                if not changed:
                    still.append(w.name)
        for check, watched, hit, what in (
            ("params_move", watched_t, still, "with a non-zero gradient and learning rate did not change at the step"),
            (
                "frozen_still",
                watched_f,
                moved,
                "with requires_grad=False that an optimizer holds changed since the last measured step",
            ),
        ):
            if watched:
                detail = f"{len(hit)} of {watched} sampled tensors {what}" if hit else None
                record(step, now, check, not hit, grouped(hit, self._every) if hit else None, float(len(hit)), detail)
