"""Output statistics of traced module calls: the ``out_*`` columns of ``python.torch_trace``.

On traced steps only (the tracer's sampled steps), the forward post hook hands each
module's output to the function ``recorder`` builds. It picks the output's first tensor
(the output itself, else the first tensor of a tuple, list or dict such as a HF
ModelOutput), and when that is a plain floating tensor on the CPU or a CUDA device it
launches five reductions on the tensor's own device and keeps the resulting 0-d tensors:

* ``std`` and ``mean`` over all elements (``torch.std_mean``, population std);
* ``batch_std``: the std across the first dimension, averaged over the other positions
  (how much the output differs between the samples of the batch; NULL when the first
  dimension has fewer than 2 entries);
* the count of non-zero elements and of finite elements (``count_nonzero``).

Nothing is read back in the forward: no ``.item()``, no host sync. At the boundary after
the traced step, ``Batch`` stacks each device's scalars into two tensors (one float64,
one int64); on the CPU they are read at once, on CUDA they are copied into pinned host
memory with ``non_blocking=True`` behind an event and written into the ring when the
event has completed (the next boundary or a query, whichever comes first).

Cost bound: an output of more than ``MAX_ELEMENTS`` elements is reduced over a strided
view (every k-th element along the last dimensions, then the first), never a copy, so a
huge logits tensor costs no more than a 4 Mi-element one and its temporaries stay small.
The counts are then those of the sample, and ``out_elements`` says how many it covered.
"""

from __future__ import annotations

__all__ = ["STATS_COLUMNS", "MAX_ELEMENTS", "recorder", "Batch"]

STATS_COLUMNS = {"out_mean": "f8", "out_std": "f8", "out_batch_std": "f8", "out_zero_frac": "f8",
                 "out_nonfinite": "f8", "out_elements": "f8", "out_shape": "O"}
MAX_ELEMENTS = 1 << 22


def _first_tensor(output, tensor_type):
    if isinstance(output, (tuple, list)):
        values = output
    elif isinstance(output, dict):
        values = output.values()
    else:
        return None
    for v in values:
        if isinstance(v, tensor_type):
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
    std_mean, std, count_nonzero, isfinite = torch.std_mean, torch.std, torch.count_nonzero, torch.isfinite
    capturing = getattr(torch.cuda, "is_current_stream_capturing", None) if cuda else None

    def stats(output):
        x = output
        if type(x) not in tensor_types:
            x = _first_tensor(x, tensor)
            if x is None or type(x) not in tensor_types:  # a subclass (DTensor...) may reduce across ranks: skip
                return None
        if not x.is_floating_point():
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
        s, m = std_mean(x, correction=0)
        b = std(x, dim=0, correction=0).mean() if x.dim() and x.shape[0] > 1 else None
        return s, m, b, count_nonzero(x), count_nonzero(isfinite(x)), n, shape

    return stats


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
        self.parts = []  # (positions, batch positions, host floats, host counts, event or None)
        by_device: dict = {}
        for i, e in enumerate(entries):
            if e is None:
                continue
            self.elements[i] = e[5]
            self.shapes[i] = str(list(e[6]))
            by_device.setdefault(e[0].device, []).append(i)
        for device, idx in by_device.items():
            es = [entries[i] for i in idx]
            with_b = [j for j, e in enumerate(es) if e[2] is not None]
            floats = torch.stack([e[0] for e in es] + [e[1] for e in es] + [es[j][2] for j in with_b]).double()
            counts = torch.stack([e[3] for e in es] + [e[4] for e in es])
            ev = None
            if self.deferred(device):
                floats, counts = self._host(floats), self._host(counts)
                ev = torch.cuda.Event()
                ev.record()
            self.parts.append((np.asarray(idx), np.asarray(with_b, dtype="i8"), floats, counts, ev))

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
        """The stats columns with what is known now (CPU values); CUDA values stay NaN until ``write``."""
        import numpy as np

        n = len(self.rows)
        cols = {name: np.full(n, np.nan) for name, dt in STATS_COLUMNS.items() if dt == "f8"}
        cols["out_elements"] = self.elements
        cols["out_shape"] = self.shapes
        self.parts = [p for p in self.parts if p[4] is not None or self._fill(cols, p)]
        return cols

    def _fill(self, cols: dict, part) -> bool:
        idx, with_b, floats, counts, _ = part
        f, c = floats.numpy(), counts.numpy()
        k = len(idx)
        elements = self.elements[idx]
        cols["out_std"][idx] = f[:k]
        cols["out_mean"][idx] = f[k:2 * k]
        if len(with_b):
            cols["out_batch_std"][idx[with_b]] = f[2 * k:]
        cols["out_zero_frac"][idx] = (elements - c[:k]) / elements
        cols["out_nonfinite"][idx] = elements - c[k:]
        return False

    def write(self, arrays: dict, count: int, capacity: int) -> bool:
        """Write the device values whose copies have landed into the ring's ``arrays``; True when all have."""
        import numpy as np

        keep = []
        for part in self.parts:
            if not part[4].query():
                keep.append(part)
                continue
            n = len(self.rows)
            cols = {name: np.full(n, np.nan) for name in ("out_std", "out_mean", "out_batch_std", "out_zero_frac",
                                                           "out_nonfinite")}
            self._fill(cols, part)
            idx = part[0]
            rows = self.rows[idx]
            live = count - rows <= capacity
            for name, values in cols.items():
                arrays[name][rows[live] % capacity] = values[idx][live]
        self.parts = keep
        return not keep

    def stale(self, count: int, capacity: int) -> bool:
        """Every row of the batch has left the ring."""
        return not len(self.rows) or count - int(self.rows.max()) > capacity
