"""Raw eval of multi-line Python inside the training process (the highest tier).

Names resolve as a user expects from the training script: the ``__main__`` globals
(``model``, ``optimizer``, ``train_loader``, ``trainer``), the probe's discovered
model/optimizer/scheduler/scaler, and, at a safe point, the locals of the training
loop's frame (``loss``, ``batch``). The code runs in a fresh namespace built from
those, so assigning a name does not rebind the training script's variable; mutate
objects instead (``optimizer.param_groups[0]["lr"] = 1e-4``).

Output printed by the eval'd code is captured per thread: other threads (the
training loop, when eval runs ``--now`` on the server thread) keep printing to the
real streams. A failure returns the traceback of the eval'd code only.
"""

from __future__ import annotations

import ast
import io
import linecache
import sys
import threading
import traceback

from .queue import Context
from .._errors import ActionError
from ..training.finder import main_globals, named
from ..util.usercode import release


MAX_OUTPUT = 1_000_000
MAX_REPR = 20_000


class _ThreadStream:
    """A stand-in for sys.stdout/err that sends the writes of capturing threads to their buffers."""

    def __init__(self, real, which: str):
        self._real, self._which = real, which

    def write(self, text):
        buf = _captures.get(threading.get_ident())
        if buf is None:
            return self._real.write(text)
        buf[self._which].write(text)
        return len(text)

    def flush(self):
        if threading.get_ident() not in _captures:
            self._real.flush()

    def __getattr__(self, name):
        return getattr(self._real, name)


_captures: dict[int, dict] = {}
_install_lock = threading.Lock()


def _install() -> None:
    with _install_lock:
        if not isinstance(sys.stdout, _ThreadStream):
            sys.stdout = _ThreadStream(sys.stdout, "stdout")
        if not isinstance(sys.stderr, _ThreadStream):
            sys.stderr = _ThreadStream(sys.stderr, "stderr")


def namespace(frame=None) -> dict:
    """The names eval'd code sees: discovered objects < __main__ globals < training-loop locals."""
    ns = dict(named())
    ns.update(main_globals())
    if frame is not None:
        loc = frame.f_locals
        ns.update(loc)
        release(frame, loc)  # the namespace holds what eval needs; the frame's cached copy need not
    ns["__name__"] = "__probe_eval__"
    ns.pop("__builtins__", None)
    return ns


def _frame(ctx: Context):
    """The user's training-loop frame at this safe point (outside torch, probe and the frameworks), or None."""
    if ctx.now or ctx.step is None:
        return None
    return ctx.frame


def _compile(code: str, filename: str):
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    return compile(tree, filename, "exec"), (compile(last, filename, "eval") if last is not None else None)


def _user_traceback(exc: BaseException, filename: str) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_code(code: str, ctx: Context) -> dict:
    """Run ``code``; return stdout, stderr and the final expression's repr, or raise with the traceback."""
    filename = f"<probe-eval-{ctx.action_id}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    frame = _frame(ctx)
    result = {
        "stdout": "",
        "stderr": "",
        "value": None,
        "step": ctx.step,
        "locals_from": f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})" if frame else None,
    }
    try:
        body, last = _compile(code, filename)
    except SyntaxError as exc:
        err = ActionError(f"the code does not parse: {exc.msg} (line {exc.lineno}); fix it and retry.")
        err.result = {**result, "traceback": "".join(traceback.format_exception_only(type(exc), exc))}
        raise err from None
    ns = namespace(frame)
    _install()
    buffers = {"stdout": io.StringIO(), "stderr": io.StringIO()}
    _captures[threading.get_ident()] = buffers
    failure = None
    try:
        exec(body, ns)
        if last is not None:
            value = eval(last, ns)
            if value is not None:
                result["value"] = _repr(value)
    except (Exception, SystemExit) as exc:  # the eval'd code's own error (Ctrl-C still reaches training)
        failure = exc
    finally:
        _captures.pop(threading.get_ident(), None)
        result["stdout"] = buffers["stdout"].getvalue()[:MAX_OUTPUT]
        result["stderr"] = buffers["stderr"].getvalue()[:MAX_OUTPUT]
    if failure is not None:
        result["traceback"] = _user_traceback(failure, filename)
        err = ActionError(f"the code raised {type(failure).__name__}: {failure}".rstrip(": ") + ".")
        err.result = result
        raise err
    return result


def _repr(value) -> str:
    try:
        text = repr(value)
    except Exception as exc:
        return f"<repr failed: {type(exc).__name__}: {exc}>"
    return text if len(text) <= MAX_REPR else text[:MAX_REPR] + f"... ({len(text)} characters)"
