"""``probe checkpoint``: weights, optimizer, scheduler, step and RNG states, written atomically at a step boundary."""

from __future__ import annotations

import os

from probe._errors import ProbeError

from . import command
from ._action import _Action, _bytes, _local


@command("checkpoint", "Save model, optimizer, scheduler, step and RNG states at the next step boundary, atomically.")
class Checkpoint(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument("path", help="File to write; {rank}, {pid} and {step} are expanded in the training process.")
        p.add_argument("--force", action="store_true", help="Overwrite an existing file.")
        _Action.add_common(p)

    def body(self, session, args, target):
        path = args.path
        if _local(target) and not os.path.isabs(os.path.expanduser(path)):
            path = os.path.abspath(path)  # relative to where the user runs probe, for a local process
        return {"path": path, "force": args.force, "now": args.now}

    def check_many(self, session, args, targets):
        if "{rank}" not in args.path and "{pid}" not in args.path:
            raise ProbeError("several processes would write the same file; put {rank} in PATH, e.g. ckpt-{rank}.pt.")

    def describe(self, args):
        return f"checkpoint {args.path}"

    def render(self, session, target, action, prefix):
        r = action.get("result") or {}
        if action["state"] != "done":
            return
        step = "" if r.get("step") is None else f" at step {r['step']}"
        session.print(
            f"{prefix}wrote {r['path']}{step}: {_bytes(r['bytes'])} in {r['seconds']:.2f} s, "
            f"sha256 {r['sha256'][:16]}... ({', '.join(r['contents'])})."
        )
        if r.get("sharded"):
            rank = r.get("rank") if r.get("rank") is not None else 0
            session.print(
                f"{prefix}the model is sharded ({r['sharded']}, FSDP2/DTensor): the file holds rank {rank}'s "
                f"shards of {r.get('world_size') or '?'}; load it on rank {rank} of a job sharded the same way, "
                f"after fully_shard: probe.load_checkpoint(path, model=model, optimizer=optimizer) "
                f"(plain torch.load needs `import torch.distributed.tensor` first)."
            )
