"""DDP replicas (docs/ranks.md): a checksum of each rank's weights at the same steps, and each DDP model's
configuration, for the doctor's rules that compare ranks or read a rank's own DDP setup.

The checksum (``torch.weight_sums``): for each parameter tensor of a DDP-wrapped model, a fixed sample of at most
``_SAMPLE`` elements summed with fixed weights in float64 on its device, read once landed (no sync, no
collective), with the number of collectives the group has issued by then; taken at each multiple of ``every`` (a
power of two, doubled while a checksum costs over ``_SHARE`` of the steps it covers), so ranks meet.

Nothing here raises into the training loop: errors go to ``probe.errors``.
"""

from __future__ import annotations

import math
import time
import weakref

from . import finder
from ..util.errorlog import record_error
from ..util.ring import Ring

__all__ = ["Replicas", "SUM_COLUMNS", "DDP_COLUMNS", "replicas"]

SUM_COLUMNS = {
    "step": "i8",
    "time": "f8",
    "model": "O",
    "position": "i8",
    "name": "O",
    "numel": "i8",
    "checksum": "f8",
    "collectives": "f8",  # a count, NULL (None) where the process group cannot say
}
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
                    host = torch.empty(sums.shape, dtype=torch.float64, pin_memory=True)
                    host.copy_(sums, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                    self._pending.append((step, now, m.label, meta, issued, host, ev))
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
