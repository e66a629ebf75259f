"""Reading the job's objects without running the job's code: kinds, instance dicts and bounded reprs.

``isinstance(obj, cls)`` reads ``obj.__class__`` when the type does not match (a property
there is the job's code, run on whatever thread asked), ``hasattr``/``getattr`` run
properties and ``__getattr__``, ``vars`` reads a ``__dict__`` property, and ``repr`` runs
``__repr__``, which may build hundreds of megabytes or block forever. So the probe asks the
type: ``is_a`` is ``issubclass(type(obj), ...)``, ``instance_dict`` returns an object's own
dict only when its type keeps one the ordinary way, and ``bounded_repr`` describes only
built-in values (cut before they are built), tensors and arrays by shape, dtype and device
(their data untouched), and anything else as ``<module.Class object at 0x...>`` from its type.

>>> class Sneaky:
...     reads = 0
...     @property
...     def __class__(self):
...         Sneaky.reads += 1
...         return int
>>> isinstance(Sneaky(), int), is_a(Sneaky(), int), Sneaky.reads
(True, False, 1)
>>> text = bounded_repr(["x" * 10**8, b"\\0" * 10**8, 2**4000, {"k": (1, 2.5, None)}])
>>> len(text) < 500, text[-64:]
(True, "...<100000000 bytes>, <int of 4001 bits>, {'k': (1, 2.5, None)}]")
>>> "Sneaky object at 0x" in bounded_repr(Sneaky()), Sneaky.reads
(True, 1)
"""

from __future__ import annotations

import sys
import types
from collections import OrderedDict, defaultdict, deque
from itertools import islice


MAX_STRING = 80  # characters (or bytes) of a string shown before it is cut
MAX_ITEMS = 6  # items of a container shown
MAX_LEVEL = 3  # levels of nested containers shown
MAX_INT_BITS = 256  # a longer int is described by its size (its decimal repr costs quadratic time)

_GETSET = types.GetSetDescriptorType
_TYPE_DICT = type.__dict__["__dict__"]  # a class's own namespace, whatever its metaclass says
_QUALNAME = type.__dict__["__qualname__"]


def is_a(obj, classes) -> bool:
    """``isinstance`` by the object's real type: never reads ``obj.__class__`` (nor runs ``__instancecheck__``)."""
    return issubclass(type(obj), classes)


def _own(cls) -> dict:
    return _TYPE_DICT.__get__(cls, type)


def instance_dict(obj) -> dict | None:
    """``vars(obj)`` when ``obj``'s type keeps its instance dict the ordinary way, else None (no ``__dict__``, or a
    class that defines ``__dict__`` itself: reading it would run the job's code)."""
    for cls in type(obj).__mro__:
        desc = _own(cls).get("__dict__")
        if desc is not None:
            if type(desc) is not _GETSET:
                return None
            try:
                d = desc.__get__(obj, type(obj))
            except Exception:
                return None
            return d if type(d) is dict else None
    return None


def type_name(cls) -> str:
    """``module.QualName`` of a class, read from the class itself (no metaclass property runs)."""
    try:
        module = _own(cls).get("__module__")
        name = _QUALNAME.__get__(cls, type)
    except Exception:
        return "?"
    module = module if type(module) is str else None
    return name if module in (None, "builtins") else f"{module}.{name}"


def _opaque(value) -> str:
    return f"<{type_name(type(value))} object at {id(value):#x}>"


def _cut_text(value, t) -> str:
    """A str's or bytes' repr built from its first ``MAX_STRING`` characters only."""
    n = t.__len__(value)
    head = t.__getitem__(value, slice(0, MAX_STRING))
    text = repr(head if t is not bytearray else bytes(head))
    if t is bytearray:
        text = f"bytearray({text})"
    return text if n <= MAX_STRING else f"{text}...<{n} {'characters' if t is str else 'bytes'}>"


def _items(value, t, level: int) -> str:
    n = len(value)
    if t is dict or t is OrderedDict or t is defaultdict:
        pairs = islice(value.items(), MAX_ITEMS)
        shown = [f"{bounded_repr(k, level - 1)}: {bounded_repr(v, level - 1)}" for k, v in pairs]
    else:
        shown = [bounded_repr(x, level - 1) for x in islice(value, MAX_ITEMS)]
    if n > MAX_ITEMS:
        shown.append(f"...<{n} items>")
    body = ", ".join(shown)
    if t is list:
        return f"[{body}]"
    if t is tuple:
        return f"({body},)" if n == 1 else f"({body})"
    if t is dict:
        return "{" + body + "}"
    if t is set:
        return "{" + body + "}" if n else "set()"
    if t is frozenset:
        return f"frozenset({{{body}}})"
    if t in (OrderedDict, defaultdict):
        return f"{t.__name__}({{{body}}})"
    return f"{t.__name__}([{body}])"


_CONTAINERS = (list, tuple, dict, set, frozenset, deque, OrderedDict, defaultdict)
_SCALARS = (bool, float, complex, type(None), type(Ellipsis), range, slice)


def _array(value, t) -> str | None:
    """A tensor or ndarray by shape, dtype and device, read through the base class's own getters (never its data)."""
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(t, torch.Tensor):
        base = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
        with torch._C.DisableTorchFunctionSubclass():
            shape = tuple(base.shape.__get__(value))
            dtype, device = base.dtype.__get__(value), base.device.__get__(value)
        name = t.__name__ if (t.__module__ or "").startswith("torch") else type_name(t)
        return f"{name}(shape={shape}, dtype={dtype}, device={device})"
    np = sys.modules.get("numpy")
    if np is not None:
        if issubclass(t, np.ndarray):
            shape, dtype = np.ndarray.shape.__get__(value), np.ndarray.dtype.__get__(value)
            return f"{'ndarray' if t is np.ndarray else type_name(t)}(shape={shape}, dtype={dtype})"
        if issubclass(t, (np.number, np.bool_)) and t.__module__ == "numpy":
            return repr(value)
    return None


def bounded_repr(value, level: int = MAX_LEVEL) -> str:
    """A short repr that runs none of the job's code, never touches tensor data (no device sync), is cut before
    it is built and never raises."""
    t = type(value)
    try:
        if t in _SCALARS:
            return repr(value)
        if t is int:
            bits = value.bit_length()
            return repr(value) if bits <= MAX_INT_BITS else f"<int of {bits} bits>"
        if t in (str, bytes, bytearray):
            return _cut_text(value, t)
        if t in _CONTAINERS:
            if level <= 0:
                return f"<{t.__name__} of {len(value)} items>"
            return _items(value, t, level)
        if t is types.FunctionType or t is types.BuiltinFunctionType or t is types.MethodType:
            return f"<{t.__name__} {_function_name(value)}>"
        if t is types.ModuleType:
            return f"<module {_own_name(value)}>"
        if issubclass(t, type):  # a class
            return f"<class {type_name(value)}>"
        described = _array(value, t)
        return described if described is not None else _opaque(value)
    except Exception as exc:
        return f"<{type_name(t)} object at {id(value):#x}: not shown ({type(exc).__name__})>"


def _function_name(fn) -> str:
    if type(fn) is types.MethodType:
        fn = fn.__func__
        if type(fn) is not types.FunctionType:
            return "?"
    name = getattr(fn, "__qualname__", None)  # a function's or builtin's own slot
    return name if type(name) is str else "?"


def _own_name(module) -> str:
    name = types.ModuleType.__dict__["__dict__"].__get__(module).get("__name__")
    return repr(name[:MAX_STRING]) if type(name) is str else "?"
