"""Emergency checkpoints: written by the training thread at a safe point, atomically.

The file is a plain ``torch.save`` dict, loadable with ``torch.load`` (weights_only safe); docs/actions.md
lists what it holds. It is written through ``probe.util.files`` (a temporary file under a name no one can
predict, fsynced and renamed, never over an existing file without ``force``) with its checksum in
``PATH.sha256``. A sharded model (FSDP2's ``fully_shard``, DTensors) is saved as it is held: this rank's
shards, written without a collective, loaded on the same rank of a job sharded the same way.

``load_checkpoint`` restores it. A checkpoint taken at the safe point sees the optimizer step done but not
the loop's ``scheduler.step()`` that follows; the checkpoint records that, and loading steps the scheduler
once so the resumed run continues exactly where the uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import sys
import time
from typing import TYPE_CHECKING

from .._errors import ActionError
from .._core import state as agent_state
from ..training.finder import framework_counters, grad_scalers, models, optimizers, scheduler_for, schedulers
from ..training.frameworks import is_sharded, objects_of, placement, restore_counters
from ..util import files
from ..util.printable import printable

if TYPE_CHECKING:
    from .queue import Context


FORMAT = "probe-checkpoint/1"
_resume = {"step": 0}


def expand_path(path: str, rank: int | None, step: int | None) -> str:
    """``{rank}``, ``{pid}`` and ``{step}`` in PATH become this process's values; ``~`` is expanded."""
    out = path.replace("{rank}", str(rank if rank is not None else 0)).replace("{pid}", str(os.getpid()))
    out = out.replace("{step}", str(step if step is not None else 0))
    return os.path.abspath(os.path.expanduser(out))


def check_target(path: str, force: bool) -> None:
    """Refuse a directory, a symbolic link or a special file (/dev/null, a FIFO) even with --force, an existing file
    without it, and a directory where other users could replace the checkpoint (``probe.util.files``); the same
    for the checksum file beside it, which is always replaced."""
    try:
        files.check_target(path, replace=force, error=ActionError)
    except FileExistsError:
        raise ActionError(_exists(path)) from None
    files.check_target(path + ".sha256", replace=True, error=ActionError)


def _exists(path: str) -> str:
    return f"{printable(path)} already exists; pass --force to overwrite it, or choose another path."


def _unwrap(model):
    inner = getattr(model, "_orig_mod", model)  # torch.compile
    return inner.module if type(inner).__name__ in ("DistributedDataParallel", "DataParallel") else inner


def _rng_state() -> dict:
    import torch

    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        rng["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _scheduler_behind(sched, step: int | None) -> bool:
    """True when the loop steps the scheduler once per optimizer step and has not yet done so for this step."""
    last = getattr(sched, "last_epoch", None)
    return step is not None and isinstance(last, int) and last == step - 1


def build_state(ctx: "Context") -> dict:
    mods, opts = models(), optimizers()
    if not mods and not opts:
        raise ActionError(
            "no model or optimizer found in the training process; name them as globals of the training script (model, "
            "optimizer) so probe can find them."
        )
    step = None if ctx.step is None else ctx.step + _resume["step"]
    state: dict = {"format": FORMAT, "step": step, "time": time.time()}
    if mods:
        state["model"] = _unwrap(mods[0].obj).state_dict()
        laid = next((placement(v) for v in state["model"].values() if is_sharded(v)), None)
        if laid is not None:
            state["sharded"] = laid  # this rank's shards only, e.g. S(0)
        if len(mods) > 1:
            state["models"] = {f.name: _unwrap(f.obj).state_dict() for f in mods}
    scheds = schedulers()
    if opts:
        state["optimizer"] = opts[0].obj.state_dict()
        if len(opts) > 1:
            state["optimizers"] = {f.name: f.obj.state_dict() for f in opts}
        mine = scheduler_for(opts[0].obj) or scheds[:1]
        if mine:
            sched = mine[0].obj
            state["scheduler"] = sched.state_dict()
            state["scheduler_step_pending"] = bool(not ctx.now and _scheduler_behind(sched, step))
    if len(scheds) > 1:
        state["schedulers"] = {f.name: f.obj.state_dict() for f in scheds}
    counters = framework_counters(in_step=not ctx.now)
    if counters:
        state["frameworks"] = counters
    scalers = grad_scalers()
    if scalers:
        state["scaler"] = scalers[0].obj.state_dict()
    state["rng"] = _rng_state()
    entry = agent_state.info()
    state["probe"] = {
        "pid": os.getpid(),
        "rank": entry.get("rank"),
        "world_size": entry.get("world_size"),
        "host": socket.gethostname(),
        "argv": list(entry.get("argv") or sys.argv),
        "at_safe_point": not ctx.now,
        "objects": {
            "models": [f.name for f in mods],
            "optimizers": [f.name for f in opts],
            "schedulers": [f.name for f in scheds],
        },
    }
    return state


def _digest(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def save(ctx: "Context", path: str, force: bool) -> dict:
    """Write the checkpoint of this process to ``path`` (already expanded); return what was written.

    The file and its ``.sha256`` go through ``probe.util.files.write_file``: new files under names no one can
    predict, renamed into place only in a directory no other user can swap files in."""
    import torch

    t0 = time.perf_counter()
    check_target(path, force)
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ActionError(
            f"cannot create the directory {printable(directory)} ({exc.strerror or exc}); choose another path."
        ) from None
    for name in (path, path + ".sha256"):
        files.sweep_temps(name)
    state = build_state(ctx)

    def checkpoint(f) -> str:
        torch.save(state, f)
        f.flush()
        f.seek(0)
        return _digest(f)

    try:
        digest = files.write_file(path, checkpoint, replace=force, error=ActionError)
    except FileExistsError:
        raise ActionError(_exists(path)) from None
    line = f"{digest}  {os.path.basename(path)}\n".encode()
    try:
        files.write_file(
            path + ".sha256",
            lambda f: f.write(line),
            error=ActionError,
            fix="the checkpoint was removed, free space or choose another directory",
        )
    except (ActionError, FileExistsError):
        os.unlink(path)  # a checkpoint without its checksum is reported as failed: do not leave it looking complete
        raise
    return {
        "path": path,
        "bytes": os.path.getsize(path),
        "sha256": digest,
        "step": state["step"],
        "seconds": round(time.perf_counter() - t0, 4),
        "contents": sorted(k for k in state if k not in ("format", "time")),
        "scheduler_step_pending": state.get("scheduler_step_pending", False),
        "sharded": state.get("sharded"),
        "rank": state["probe"]["rank"],
        "world_size": state["probe"]["world_size"],
    }


def load_checkpoint(
    path: str,
    *,
    model=None,
    optimizer=None,
    scheduler=None,
    scaler=None,
    trainer=None,
    map_location="cpu",
    restore_rng: bool = True,
    verify: bool = True,
) -> dict:
    """Restore a checkpoint written by ``probe checkpoint``; return the loaded dict (``step`` included).

    ``trainer`` (a Lightning or transformers Trainer, or an accelerate Accelerator) supplies the
    model, optimizer and scheduler not given, through the framework's own attributes; a Trainer
    gets its ``global_step`` back (Lightning's also its ``current_epoch``), an Accelerator its
    ``step``. Loaded inside a step (``eval --at-step``), the step finishing
    then is counted on top by the Trainer, as after any step.

    A sharded model's file (FSDP2) holds one rank's shards: load it on that rank, after
    ``init_process_group`` and ``fully_shard`` with the same world size, each rank its own file
    (``ckpt-{rank}.pt``).

    The file and its ``.sha256`` must belong to this user or root: one another user could have put in a
    shared directory is refused, as is a directory or a special file at ``path``.
    """
    import torch

    path = os.path.expanduser(path)
    if not os.path.lexists(path):
        raise ActionError(
            f"no checkpoint at {printable(path)}; check the path (a probe checkpoint's {{rank}} is expanded when it "
            "is written)."
        )
    with files.open_own(path, ActionError, "checkpoint") as f:
        if verify and os.path.lexists(path + ".sha256"):
            with files.open_own(path + ".sha256", ActionError, "checksum file") as sums:
                want = (sums.read(4096).split() or [b""])[0].decode(errors="replace")
            if _digest(f) != want:
                raise ActionError(
                    f"{printable(path)} does not match its checksum in {printable(path)}.sha256; the file is damaged "
                    "or was changed."
                )
            f.seek(0)
        try:
            state = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as exc:
            if "torch.distributed.tensor" not in str(exc):
                raise
            import torch.distributed.tensor  # noqa: F401  (registers DTensor with the weights-only loader)

            f.seek(0)
            state = torch.load(f, map_location=map_location, weights_only=True)  # a sharded model's (FSDP2) file
    if trainer is not None:
        held = objects_of(trainer)
        model = model if model is not None else held.get("model")
        optimizer = optimizer if optimizer is not None else held.get("optimizer")
        scheduler = scheduler if scheduler is not None else held.get("scheduler")
    if model is not None and "model" in state:
        _unwrap(model).load_state_dict(state["model"])
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
        if state.get("scheduler_step_pending"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scheduler.step()
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    if restore_rng and "rng" in state:
        _restore_rng(state["rng"])
    if trainer is not None:
        for counters in (state.get("frameworks") or {}).values():
            if restore_counters(trainer, counters):
                break
    _resume["step"] = int(state.get("step") or 0)
    return state


def _restore_rng(rng: dict) -> None:
    import torch

    if "python" in rng:
        random.setstate(_tuples(rng["python"]))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in rng:
        s = rng["numpy"]
        np.random.set_state(
            (s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
