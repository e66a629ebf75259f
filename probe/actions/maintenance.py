"""Maintenance on demand: cleanup (gc, CUDA cache, optional zero_grad), a debugger (debugpy), and torch.profiler
for the next N steps of a live job, written as a Chrome trace.

``start_profile`` runs as a queued action at a step boundary: it starts ``torch.profiler``
(CPU, and CUDA where a GPU is in use) and subscribes to the step boundary; the N-th
boundary after that stops the profiler and exports the Chrome trace into the runtime
directory (mode 0600). The profiler exists only during those N steps: before and after,
the loop runs without it. ``current_profile()`` reports the profile's state for the CLI, which
waits for ``done`` and then reads the trace in chunks through the connection (never by its
path: a client cannot tell that a path an endpoint names is the job's).

One profile at a time: a second request, or one while the user's own profiler is
active, is refused with a sentence saying why.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

from .queue import Context
from .._errors import ActionError
from .._runtime import runtime_dir
from ..training.finder import optimizers
from .._core.boundary import StepEvent, boundary
from ..util.errorlog import record_error
from ..util.procfs import rss_bytes


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


PROFILE_MAX_STEPS = 100
PROFILE_CHUNK = 4 * 1024 * 1024  # bytes of trace per read: keeps each answer of the server bounded

_profile_lock = threading.Lock()
_profile: dict = {}  # the current or last profile: state, steps, path, ...


def current_profile() -> dict:
    with _profile_lock:
        return {k: v for k, v in _profile.items() if k != "prof"}


def stop_profile() -> None:
    """End a running profile without writing its trace (the probe stopped): the profiler stops and the step
    boundary loses its subscriber."""
    with _profile_lock:
        if _profile.get("state") != "running":
            return
        boundary.remove(_at_step)
        _profile.pop("mark", None)
        prof = _profile.pop("prof")
        _profile.update(
            state="failed", error="the probe stopped before the profile's last step.", finished_at=time.time()
        )
    try:
        prof.stop()
    except Exception as exc:
        record_error("profile-steps: stopping", exc)


def _user_profiler_active(torch) -> bool:
    try:
        return bool(torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled())
    except AttributeError:
        return False


def start_profile(ctx: Context, steps: int, with_stack: bool = False, record_shapes: bool = False) -> dict:
    """The action: start profiling at this boundary for ``steps`` steps."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise ActionError("torch is not imported in this process, so there is nothing for torch.profiler to profile.")
    if ctx.now or ctx.step is None:
        raise ActionError("profile-steps starts at a step boundary; this process has not reached one yet.")
    with _profile_lock:
        if _profile.get("state") == "running":
            raise ActionError(
                f"a profile is already running in this process (steps {_profile['from_step']}"
                f"-{_profile['until_step']}); wait for it to finish."
            )
        if _user_profiler_active(torch):
            raise ActionError(
                "a torch profiler is already active in this process (the training script's own?); "
                "torch allows one at a time, so stop it first or read its trace."
            )
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        path = os.path.join(runtime_dir(), f"profile-{os.getpid()}-{ctx.action_id}.json")
        prof = profile(activities=activities, with_stack=with_stack, record_shapes=record_shapes)
        prof.start()
        mark = _mark(torch, ctx.step + 1)
        _profile.clear()
        _profile.update(
            state="running",
            action_id=ctx.action_id,
            steps=steps,
            from_step=ctx.step + 1,
            until_step=ctx.step + steps,
            path=path,
            activities=[a.name for a in activities],
            started_at=time.time(),
            prof=prof,
            mark=mark,
            pid=os.getpid(),
        )
        boundary.after_step(_at_step)
    return {
        "state": "running",
        "from_step": ctx.step + 1,
        "until_step": ctx.step + steps,
        "activities": [a.name for a in activities],
        "path": path,
    }


def _mark(torch, step: int):
    """A ``ProfilerStep#N`` slice from this boundary to the next (opened on the training thread)."""
    rf = torch.profiler.record_function(f"ProfilerStep#{step}")
    rf.__enter__()
    return rf


def _at_step(event: StepEvent) -> None:
    with _profile_lock:
        if _profile.get("state") != "running":
            return
        _profile.pop("mark").__exit__(None, None, None)
        if event.step < _profile["until_step"]:
            _profile["mark"] = _mark(sys.modules["torch"], event.step + 1)
            return
        boundary.remove(_at_step)
        prof = _profile.pop("prof")
        path = _profile["path"]
        try:
            prof.stop()
            exported = time.perf_counter()
            tmp = path + ".tmp"
            prof.export_chrome_trace(tmp)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
            _profile.update(
                state="done",
                ended_step=event.step,
                finished_at=time.time(),
                bytes=os.path.getsize(path),
                export_s=round(time.perf_counter() - exported, 3),
            )
        except Exception as exc:
            record_error("profile-steps", exc)
            _profile.update(state="failed", error=f"{type(exc).__name__}: {exc}", finished_at=time.time())


def read_profile_chunk(path: str, offset: int) -> dict:
    """Up to PROFILE_CHUNK bytes of a finished profile's trace, base64-encoded, for the client to write."""
    import base64

    with _profile_lock:
        if path != _profile.get("path") or _profile.get("state") != "done":
            raise ActionError("no finished profile with that path in this process; run profile-steps first.")
    with open(path, "rb") as f:
        f.seek(max(0, int(offset)))
        data = f.read(PROFILE_CHUNK)
        size = os.fstat(f.fileno()).st_size
    end = max(0, int(offset)) + len(data)
    return {
        "data": base64.b64encode(data).decode(),
        "offset": int(offset),
        "next": end if end < size else None,
        "size": size,
    }
