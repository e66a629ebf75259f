"""What a traced step records of each module call, and the rows it writes at the boundary after it (docs/torch.md).

``call_hooks``: the forward pre/post hook pair, a few operations per call. The post hook hands the output to
``recorder``'s function, which launches a few reductions of its first floating tensor on that tensor's device
(``_reduce``: deviations from the batch mean, so no cancellation) and reads nothing back; small outputs are
copied and reduced at the boundary in one batch per shape, large ones over a strided view. At the boundary
``step_records`` names and orders the calls, ``columns`` lays them out for the ring, ``Batch`` brings the
statistics to the host, and device values are written once landed (``landed_*``).
"""

from __future__ import annotations

import time
import weakref

from . import finder
from ..util.errorlog import record_error
from ..util.objects import is_a
from ..util.ring import copy_off


# -- the hooks ----------------------------------------------------------------------
MEM_PERIOD = 0.0005
MAX_STATS_CALLS = 20000  # module calls of one traced step that get output statistics (small ones hold a copy)


def call_hooks(tracer, stat) -> tuple:
    """The global forward pre/post hook pair that records each module call of ``tracer``'s sampled step (``stat``:
    a call's output statistics, from ``recorder``; None: none). They do the least that keeps a call's record (a
    perf_counter reading each side, a stack push and pop, one tuple); two variants (CPU, CUDA) keep a device test
    out of them. While dynamo traces a compiled module they do nothing (``is_dynamo_compiling`` is constant-folded
    to True there), so a ``fullgraph`` compile sees no side effect. No ``always_call``: a post hook that a raising
    module skips leaves its entry on the stack, and the next post hook pops past it."""
    torch = tracer.torch
    stack = tracer.stack
    push, pop = stack.append, stack.pop
    add = tracer.rows.append
    rstack = tracer.rstack
    add_recomputed = tracer.recomputed.append
    graph_task = getattr(torch._C, "_current_graph_task_id", None) or (lambda: -1)  # -1: not in a backward pass
    perf = time.perf_counter
    mem = tracer.mem
    read_mem = tracer.read_mem
    new_event = tracer.new_event
    tc = getattr(torch, "compiler", None)
    compiling = getattr(tc, "is_dynamo_compiling", None) or getattr(tc, "is_compiling", None) or (lambda: False)
    grad_enabled = torch.is_grad_enabled
    watch_backward = tracer.watch_backward
    period = MEM_PERIOD
    out_stats = tracer.out_stats
    failures = [0]
    keep = out_stats.append

    def stats(output):  # the output statistics of the call just added; never raises into the forward
        if len(out_stats) >= MAX_STATS_CALLS:  # a step that never ends (no boundary): keep no more
            keep(None)
            return
        nonlocal stat
        try:
            keep(stat(output))
        except Exception as exc:
            keep(None)
            failures[0] += 1
            record_error("torch trace: output statistics", exc)
            if failures[0] >= 10:  # something in this job's outputs we cannot reduce: stop trying
                tracer.stats_on, stat = False, None

    def recompute_post(module, ev1):
        """The end of a recomputed call: its own stack, its own rows, no statistics or backward watch."""
        t1 = perf()
        while rstack:
            entry = rstack.pop()
            if entry[0] is module:
                add_recomputed((module, entry[1], t1, mem[1]) + ((entry[2], ev1) if ev1 is not None else ()))
                return

    def pre(module, args):
        if not compiling():
            (push if graph_task() == -1 else rstack.append)((module, perf()))

    def post(module, args, output):
        if compiling():
            return
        if graph_task() != -1:
            recompute_post(module, None)
            return
        if not stack:
            return
        t1 = perf()
        m, t0 = pop()
        while m is not module and stack:  # a call that raised past its own post hook
            m, t0 = pop()
        if m is not module:
            return
        if t1 - mem[0] > period:
            mem[0] = t1
            mem[1] = read_mem()
        if stack:
            add((module, t0, t1, mem[1], len(stack)))
        else:
            add((module, t0, t1, mem[1], 0))
            if grad_enabled():
                watch_backward(module, output)
        if stat is not None:
            stats(output)

    def pre_cuda(module, args):
        if not compiling():
            ev = new_event()
            (push if graph_task() == -1 else rstack.append)((module, perf(), ev))

    def post_cuda(module, args, output):
        if compiling():
            return
        if graph_task() != -1:
            recompute_post(module, new_event())
            return
        if not stack:
            return
        ev1 = new_event()
        t1 = perf()
        m, t0, ev0 = pop()
        while m is not module and stack:
            m, t0, ev0 = pop()
        if m is not module:
            return
        if t1 - mem[0] > period:
            mem[0] = t1
            mem[1] = read_mem()
        depth = len(stack)
        add((module, t0, t1, mem[1], depth, ev0, ev1))
        if not depth and grad_enabled():
            watch_backward(module, output)
        if stat is not None:
            stats(output)

    return (pre_cuda, post_cuda) if tracer.cuda else (pre, post)


# -- output statistics -------------------------------------------------------------------------------
_STATS = ("out_std", "out_mean", "out_batch_std", "out_zero_frac", "out_nonfinite")  # what _fill writes
STATS_COLUMNS = dict(out_mean="f8", out_std="f8", out_batch_std="f8", out_zero_frac="f8", out_nonfinite="f8")
STATS_COLUMNS.update(out_elements="f8", out_shape="O")
MAX_ELEMENTS = 1 << 22
SMALL = 1 << 12  # outputs up to this many elements are copied in the hook and reduced in bulk at the boundary
COPY_BUDGET = 1 << 22  # elements copied that way per traced step; past it, small outputs are reduced in the hook too


def _first_tensor(output, tensor_type):
    """The first tensor of a tuple, list or dict output (checked by type: the output is the job's object)."""
    values = output.values() if is_a(output, dict) else output if is_a(output, (tuple, list)) else ()
    return next((v for v in values if is_a(v, tensor_type)), None)


def _strided(x, n: int):
    """A view of ``x`` with at most about MAX_ELEMENTS elements: strides along the last dims, the first last."""
    k = -(-n // MAX_ELEMENTS)
    index = [slice(None)] * x.dim()
    for d in list(range(x.dim() - 1, 0, -1)) + [0]:
        if k <= 1:
            break
        step = min(k, x.shape[d])
        if step > 1:
            index[d] = slice(None, None, step)
            k = -(-k // step)
    return x[tuple(index)]


def recorder(torch, cuda: bool):
    """The function the forward post hook calls on a module's output: a tuple of device scalars, or None."""
    tensor_types = (torch.Tensor, torch.nn.Parameter)
    dtypes = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    capturing = getattr(torch.cuda, "is_current_stream_capturing", None) if cuda else None
    last = [None, -1, None]  # weak reference to the last tensor reduced, its version counter, its statistics
    budget = [COPY_BUDGET]
    ref = weakref.ref

    def stats(output):
        seen = last[0]
        if seen is not None and seen() is output and output._version == last[1]:
            return last[2]  # a container returning its last child's output unchanged (Sequential)
        got = reduce(output)
        if got is not None and type(output) in tensor_types and not output.is_inference():
            last[0], last[1], last[2] = ref(output), output._version, got
        return got

    def reduce(output):
        x = output
        if type(x) not in tensor_types:
            x = _first_tensor(x, torch.Tensor)
            if x is None or type(x) not in tensor_types:  # a subclass (DTensor...) may reduce across ranks: skip
                return None
        if x.dtype not in dtypes:  # float8 and complex have no mean
            return None
        if (x.is_cuda and (capturing is None or capturing())) or not (x.is_cuda or x.is_cpu) or not (n := x.numel()):
            return None  # inside a CUDA graph capture (launch nothing), another device, or empty
        shape = x.shape
        x = x.detach()
        if n > MAX_ELEMENTS:
            x = _strided(x, n)
            n = x.numel()
        if not x.dim():
            x = x.reshape(1)
        if n <= SMALL and budget[0] >= n:
            budget[0] -= n
            return (x.clone(), shape)  # reduced at the boundary with the others of its shape: one op now
        return _reduce(x, 0) + (n, shape, x.shape[0])

    def new_step():
        budget[0] = COPY_BUDGET

    stats.new_step = new_step
    return stats


def _reduce(x, dim: int):
    """(spread around the batch means, mean, variance of the batch means, non-zeros, non-finite) along ``dim``,
    the batch dimension: 0 for one output, 1 for a stack of same-shaped outputs (one value per output)."""
    import torch

    m = x.mean(dim, keepdim=True)
    var, mean = torch.var_mean(m.flatten(dim), dim=dim, correction=0)
    return (
        torch.linalg.vector_norm((x - m).flatten(dim), dim=dim),
        mean,
        var,
        torch.count_nonzero(x.flatten(dim), dim=dim),
        torch.count_nonzero((x - x).flatten(dim), dim=dim),
    )


class Batch:
    """The statistics of one traced step on their way from the device to the ring: ``rows``, ring row numbers;
    ``entries``, the recorder's tuples (or None), one per row."""

    def __init__(self, torch, rows, entries):
        import numpy as np

        self.torch = torch
        self.rows = np.asarray(rows, dtype="i8")
        n = len(entries)
        self.elements = np.full(n, np.nan)
        self.shapes = np.empty(n, dtype=object)
        self.batch = np.full(n, np.nan)
        self.parts = []  # (positions, host floats, host counts, event or None)
        pieces: dict = {}  # device -> [(positions, the five per-output results of _reduce)]
        small: dict = {}  # (device, dtype, shape) -> positions of small outputs to reduce together
        large: dict = {}  # device -> positions of outputs already reduced in the hook
        for i, e in enumerate(entries):
            if e is None:
                continue
            if len(e) == 2:  # a small output's copy
                x = e[0]
                self.elements[i], self.batch[i], self.shapes[i] = x.numel(), x.shape[0], str(list(e[1]))
                small.setdefault((x.device, x.dtype, x.shape), []).append(i)
            else:
                self.elements[i], self.batch[i], self.shapes[i] = e[5], e[7], str(list(e[6]))
                large.setdefault(e[0].device, []).append(i)
        for (device, _, _), idx in small.items():
            pieces.setdefault(device, []).append((idx, _reduce(torch.stack([entries[i][0] for i in idx]), 1)))
        for device, idx in large.items():
            pieces.setdefault(device, []).append((idx, [torch.stack([entries[i][k] for i in idx]) for k in range(5)]))
        for device, got in pieces.items():
            idx = [i for positions, _ in got for i in positions]
            floats = torch.cat([r[k].double() for k in range(3) for _, r in got])
            counts = torch.cat([r[k] for k in (3, 4) for _, r in got])
            ev = None
            if self.deferred(device):
                floats, _ = copy_off(torch, floats)
                counts, ev = copy_off(torch, counts)
            self.parts.append((np.asarray(idx), floats, counts, ev))

    @staticmethod
    def deferred(device) -> bool:
        """Whether the values on ``device`` are read later, once their copies have landed (CUDA), or now."""
        return device.type == "cuda"

    def columns(self) -> dict:
        """The stats columns with the CPU values; masked (NULL) where not computed, CUDA ones until ``write``."""
        import numpy as np

        n = len(self.rows)
        cols = {name: np.ma.masked_all(n) for name, dt in STATS_COLUMNS.items() if dt == "f8"}
        cols["out_elements"] = np.ma.masked_invalid(self.elements)  # NaN here marks a call without statistics
        cols["out_shape"] = self.shapes
        self.parts = [p for p in self.parts if p[3] is not None or self._fill(cols, p)]
        return cols

    def _fill(self, cols: dict, part) -> bool:
        import numpy as np

        idx, floats, counts, _ = part
        f, c = floats.numpy(), counts.numpy()
        k = len(idx)
        n, batch = self.elements[idx], self.batch[idx]
        within = f[:k] ** 2 / n  # the variance across the batch, averaged over positions
        cols["out_mean"][idx] = f[k : 2 * k]  # the mean of the per-position batch means is the output's mean
        cols["out_std"][idx] = np.sqrt(within + f[2 * k :])  # total variance = within positions + between them
        cols["out_batch_std"][idx] = np.ma.masked_where(batch <= 1, np.sqrt(within))  # one sample: no spread
        cols["out_zero_frac"][idx] = (n - c[:k]) / n
        cols["out_nonfinite"][idx] = c[k:]
        return False

    def write(self, ring) -> bool:
        """Write the device values whose copies have landed into ``ring``; True when all have."""
        import numpy as np

        keep = []
        for part in self.parts:
            if not part[3].query():
                keep.append(part)
                continue
            n = len(self.rows)
            cols = {name: np.ma.masked_all(n) for name in _STATS}
            self._fill(cols, part)
            idx = part[0]
            rows = self.rows[idx]
            live = ring.count - rows <= ring.capacity
            at = rows[live] % ring.capacity
            for name, values in cols.items():
                ring.arrays[name][at] = np.ma.getdata(values[idx][live])
                ring.valid[name][at] = ~np.ma.getmaskarray(values[idx][live])
        self.parts = keep
        return not keep

    def stale(self, count: int, capacity: int) -> bool:
        """Every row of the batch has left the ring."""
        return not len(self.rows) or count - int(self.rows.max()) > capacity


# -- a traced step's rows ----------------------------------------------------------------------------
class ModuleNames:
    """``name_of(module)``: ``(dotted path, model name)`` of a module of a found model, else (its class name, '');
    kept by id with a weakref check, so a module that is gone is never named."""

    def __init__(self):
        self._names: dict = {}

    def name_of(self, module) -> tuple[str, str]:
        key = id(module)
        hit = self._names.get(key)
        if hit is not None and hit[0]() is module:
            return hit[1], hit[2]
        for root_name, root, _, _ in finder.known("model"):
            if root is module:
                self._names[key] = (weakref.ref(module), root_name, root_name)
                return root_name, root_name
            for name, sub in root.named_modules():
                try:
                    self._names[id(sub)] = (weakref.ref(sub), finder.module_path(name) or root_name, root_name)
                except TypeError:
                    pass
            hit = self._names.get(key)
            if hit is not None and hit[0]() is module:
                return hit[1], hit[2]
        name = type(module).__name__
        try:
            self._names[key] = (weakref.ref(module), name, "")
        except TypeError:
            pass
        return name, ""


def step_records(rows, out, back, again, name_of) -> list:
    """One traced step's calls in time order, ``(t0, module, model, cls, stage, t1, mem, depth, ev0, ev1, stats)``:
    forward ``rows`` (statistics ``out``), backward cuts ``back``, recomputations ``again`` (at their forward depth)."""
    records = []
    for r, st in zip(rows, out):  # (module, t0, t1, mem, depth) on CPU, plus (ev0, ev1) on CUDA
        m = r[0]
        name, model = name_of(m)
        evs = r[5:] if len(r) > 5 else (None, None)
        records.append((r[1], name, model, type(m).__name__, "forward", r[2], r[3], r[4], *evs, st))
    for m, t0, t1, memv, ev0, ev1 in back:
        name, model = name_of(m)
        records.append((t0, name, model, type(m).__name__, "backward", t1, memv, 0, ev0, ev1, None))
    if again:
        depth_of = {}
        for r in rows:
            depth_of.setdefault(id(r[0]), r[4])
        for r in again:  # (module, t0, t1, mem) on CPU, plus (ev0, ev1) on CUDA
            m = r[0]
            name, model = name_of(m)
            evs = r[4:] if len(r) > 4 else (None, None)
            depth = depth_of.get(id(m), name.count(".") + 1 if model else 0)
            records.append((r[1], name, model, type(m).__name__, "recompute", r[2], r[3], depth, *evs, None))
    records.sort(key=lambda r: r[0])
    return records


def columns(records: list, step: int, wall_offset: float, rank, cuda: bool = False) -> dict:
    """The ring's columns of ``records`` but the statistics; CUDA durations are NULL until ``landed_durations``."""
    import numpy as np

    n = len(records)
    t0 = np.fromiter((r[0] for r in records), "f8", n)
    t1 = np.fromiter((r[5] for r in records), "f8", n)
    memv = np.fromiter((r[6] for r in records), "f8", n)
    peak = np.fmax.accumulate(memv) if n else memv
    cols = {
        "step": np.full(n, step, "i8"),
        "seq": np.arange(n, dtype="i8"),
        "module": np.array([r[1] for r in records], dtype=object),
        "stage": np.array([r[4] for r in records], dtype=object),
        "duration": np.ma.masked_all(n) if cuda else t1 - t0,
        "allocated": memv,
        "max_allocated": peak,
        "time": t0 + wall_offset,
        "rank": np.full(n, np.nan if rank is None else rank, "f8"),
        "depth": np.fromiter((r[7] for r in records), "i8", n),
        "model": np.array([r[2] for r in records], dtype=object),
        "module_type": np.array([r[3] for r in records], dtype=object),
    }
    return cols


def landed_durations(ring, pending: list, pool: list) -> list:
    """Write the CUDA durations of ``pending`` (row, start and end event) that completed into ``ring``; return the
    others. Events done with go back to ``pool``."""
    keep = []
    dur, known = ring.arrays["duration"], ring.valid["duration"]
    for row, ev0, ev1 in pending:
        if ring.count - row > ring.capacity:
            pool.extend((ev0, ev1))
            continue
        try:
            done = ev1.query()
        except Exception as exc:
            record_error("torch trace: cuda event", exc)
            continue
        if done:
            dur[row % ring.capacity] = ev0.elapsed_time(ev1) / 1000.0
            known[row % ring.capacity] = True
            pool.extend((ev0, ev1))
        else:
            keep.append((row, ev0, ev1))
    return keep


def landed_stats(ring, pending: list) -> list:
    """Write the statistics of ``pending`` Batches that landed into ``ring``; return the others (stale ones dropped)."""
    keep = []
    for batch in pending:
        try:
            if batch.stale(ring.count, ring.capacity) or batch.write(ring):
                continue
        except Exception as exc:
            record_error("torch trace: output statistics", exc)
            continue
        keep.append(batch)
    return keep
