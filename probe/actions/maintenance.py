"""Cleanup (gc, CUDA cache, optional zero_grad) and a debugger on demand (debugpy)."""

from __future__ import annotations

import gc
import os
import sys
import threading

from .queue import Context
from .._errors import ActionError
from ..training.finder import optimizers
from ..util.procfs import rss_bytes

__all__ = ["cleanup", "debug"]


def _cuda_in_use():
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch
    return None


def _memory() -> dict:
    out = {"rss": rss_bytes()}
    torch = _cuda_in_use()
    if torch is not None:
        out["cuda_allocated"] = int(torch.cuda.memory_allocated())
        out["cuda_reserved"] = int(torch.cuda.memory_reserved())
    return out


def _grad_bytes() -> int:
    total = 0
    for _, opt, _, _ in optimizers():
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    total += p.grad.numel() * p.grad.element_size()
    return total


def cleanup(ctx: Context, zero_grad: bool) -> dict:
    before = _memory()
    out = {"step": ctx.step, "before": before}
    if zero_grad:
        if not ctx.now and ctx.step is None:
            raise ActionError("--zero-grad runs only at a step boundary.")
        out["grad_bytes_freed"] = _grad_bytes()
        for _, opt, _, _ in optimizers():
            opt.zero_grad(set_to_none=True)
    out["gc_collected"] = gc.collect()
    torch = _cuda_in_use()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out["cuda_empty_cache"] = True
    after = _memory()
    out["after"] = after
    out["freed"] = {k: (before[k] - after[k]) for k in after if before.get(k) is not None and after[k] is not None}
    return out


_debug: dict = {}
_debug_lock = threading.Lock()


def debug(ctx: Context, port: int) -> dict:
    """Start debugpy on loopback (once); a second call reports the same endpoint."""
    with _debug_lock:
        if _debug:
            return {**_debug, "already": True}
        try:
            import debugpy
        except ImportError:
            raise ActionError(
                f"debugpy is not installed in the training environment ({sys.executable}); install it with "
                f"`{sys.executable} -m pip install debugpy` and retry."
            ) from None
        try:
            host, bound = debugpy.listen(("127.0.0.1", int(port)))
        except Exception as exc:
            raise ActionError(f"debugpy could not listen on 127.0.0.1:{port} ({exc}); choose another --port.") from None
        _debug.update(
            host=host,
            port=int(bound),
            pid=os.getpid(),
            debugpy=getattr(debugpy, "__version__", None),
            vscode=launch_config(host, int(bound), os.getpid(), os.getcwd()),
        )
        # the job's owner should know, even if someone else started it: one line on its stderr
        print(
            f"probe: debugpy listens on {host}:{bound} without authentication; any local user who reaches it "
            "can run code in this process until it exits.",
            file=sys.stderr,
            flush=True,
        )
        return {**_debug, "already": False}


def launch_config(host: str, port: int, pid: int, cwd: str | None) -> dict:
    """A VS Code launch configuration that attaches to the listening debugpy."""
    cfg = {
        "name": f"Attach to training pid {pid}",
        "type": "debugpy",
        "request": "attach",
        "connect": {"host": host, "port": port},
        "justMyCode": False,
    }
    if cwd:
        cfg["pathMappings"] = [{"localRoot": "${workspaceFolder}", "remoteRoot": cwd}]
    return cfg
