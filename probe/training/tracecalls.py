"""What a traced step's hooks record of each module call: its times, memory and depth, and its output's statistics (the
``out_*`` columns of ``python.torch_trace``).

The forward pre/post hook pair (``call_hooks``) notes each call in a few operations; names, sequence numbers and the
ring write wait for the boundary (``traceout``).

The forward post hook hands each module's output to the function ``recorder`` builds. For the output's first tensor
(itself, else the first tensor of a tuple, list or dict), when it is a plain floating tensor on the CPU or a CUDA
device, it launches a few reductions on the tensor's own device and keeps the 0-d results: ``m = x.mean(0)`` (the
mean over the batch dimension at each position) and the mean and variance of ``m``; the L2 norm of ``x - m``; the
counts of non-zero and of non-finite elements (``count_nonzero(x - x)``: NaN exactly where ``x`` is NaN or
infinite). The host derives ``batch_std`` (the RMS over positions of the std across the batch), the mean and the
population std (within-position variance plus the variance of ``m``): deviations from ``m`` rather than E[x^2] -
E[x]^2, so no cancellation. Each reduction is one memory-bound pass in the output's own dtype. Nothing is read back
in the forward: at the boundary ``Batch`` stacks each device's scalars (read at once on the CPU; on CUDA copied into
pinned memory behind an event and written when it has completed). Small outputs (up to ``SMALL`` elements,
``COPY_BUDGET`` in all per step) are copied in the hook and reduced at the boundary in one batch per shape. An
output over ``MAX_ELEMENTS`` elements is reduced over a strided view, never a copy; ``out_elements`` says how many
elements the figures cover.
"""

from __future__ import annotations

import time
import weakref

from ..util.errorlog import record_error
from ..util.objects import is_a


# -- the hooks ----------------------------------------------------------------------
MEM_PERIOD = 0.0005
MAX_STATS_CALLS = 20000  # module calls of one traced step that get output statistics (small ones hold a copy)


def call_hooks(tracer, stat) -> tuple:
    """The global forward pre/post hook pair that records each module call of ``tracer``'s sampled step
    (``stat``: a call's output statistics, from ``recorder``; None: none).

    Every module call of the step runs these two functions, so they do the least
    that keeps a call's record: a perf_counter reading each side, a stack push and
    pop, one tuple appended; names, sequence numbers and the ring write wait for the
    boundary. Two variants (CPU, CUDA) keep a device test out of the hot path. While
    dynamo traces a compiled module the hooks do nothing (``is_dynamo_compiling`` is
    False in eager code and constant-folded to True by dynamo), so a ``fullgraph``
    compile sees no side effect to break on. No ``always_call``: a post hook that a
    raising module skips leaves its entry on the stack, and the next post hook pops
    past it.
    """
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
        if compiling():
            return
        if graph_task() != -1:
            rstack.append((module, perf()))
            return
        push((module, perf()))

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
        if compiling():
            return
        ev = new_event()
        ev.record()
        if graph_task() != -1:
            rstack.append((module, perf(), ev))
            return
        push((module, perf(), ev))

    def post_cuda(module, args, output):
        if compiling():
            return
        if graph_task() != -1:
            ev1 = new_event()
            ev1.record()
            recompute_post(module, ev1)
            return
        if not stack:
            return
        ev1 = new_event()
        ev1.record()
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
STATS_COLUMNS = {
    "out_mean": "f8",
    "out_std": "f8",
    "out_batch_std": "f8",
    "out_zero_frac": "f8",
    "out_nonfinite": "f8",
    "out_elements": "f8",
    "out_shape": "O",
}
MAX_ELEMENTS = 1 << 22
SMALL = 1 << 12  # outputs up to this many elements are copied in the hook and reduced in bulk at the boundary
COPY_BUDGET = 1 << 22  # elements copied that way per traced step; past it, small outputs are reduced in the hook too


def _first_tensor(output, tensor_type):
    if is_a(output, (tuple, list)):  # by type: a module's output is the job's object
        values = output
    elif is_a(output, dict):
        values = output.values()
    else:
        return None
    for v in values:
        if is_a(v, tensor_type):
            return v
    return None


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
    tensor = torch.Tensor
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
            x = _first_tensor(x, tensor)
            if x is None or type(x) not in tensor_types:  # a subclass (DTensor...) may reduce across ranks: skip
                return None
        if x.dtype not in dtypes:  # float8 and complex have no mean
            return None
        if x.is_cuda:
            if capturing is None or capturing():  # inside a CUDA graph capture: launch nothing
                return None
        elif not x.is_cpu:
            return None
        n = x.numel()
        if not n:
            return None
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
    """(spread around the batch means, mean, variance of the batch means, non-zeros, non-finite) along ``dim``.

    ``dim`` is the batch dimension: 0 for one output, 1 for a stack of same-shaped outputs
    (each result then has one value per output).
    """
    import torch

    m = x.mean(dim, keepdim=True)
    flat = m.flatten(dim)
    var, mean = torch.var_mean(flat, dim=dim, correction=0)
    return (
        torch.linalg.vector_norm((x - m).flatten(dim), dim=dim),
        mean,
        var,
        torch.count_nonzero(x.flatten(dim), dim=dim),
        torch.count_nonzero((x - x).flatten(dim), dim=dim),
    )


class Batch:
    """The statistics of one traced step, on their way from the device to the ring."""

    def __init__(self, torch, rows, entries):
        """``rows``: ring row numbers; ``entries``: the recorder's tuples (or None), one per row."""
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
                floats, counts = self._host(floats), self._host(counts)
                ev = torch.cuda.Event()
                ev.record()
            self.parts.append((np.asarray(idx), floats, counts, ev))

    @staticmethod
    def deferred(device) -> bool:
        """Whether the values on ``device`` are read later, once their copy has landed (CUDA), or now."""
        return device.type == "cuda"

    def _host(self, t):
        """A pinned host copy of device tensor ``t``, enqueued without waiting for it."""
        if not t.is_cuda:
            return t
        host = self.torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def columns(self) -> dict:
        """The stats columns with what is known now (CPU values); masked (SQL NULL) where not computed,
        and CUDA values stay masked until ``write``."""
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
            cols = {
                name: np.ma.masked_all(n)
                for name in ("out_std", "out_mean", "out_batch_std", "out_zero_frac", "out_nonfinite")
            }
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
