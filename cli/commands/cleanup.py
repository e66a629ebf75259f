"""``probe cleanup``: gc and empty the CUDA cache at a step boundary, memory before and after."""

from __future__ import annotations

from . import command
from ._action import _Action, _bytes


@command("cleanup", "Run gc and empty the CUDA cache at the next step boundary; report memory before and after.")
class Cleanup(_Action):
    @staticmethod
    def add_arguments(p):
        p.add_argument("--zero-grad", action="store_true", help="Also free gradients (zero_grad(set_to_none=True)).")
        _Action.add_common(p)

    def body(self, session, args, target):
        return {"zero_grad": args.zero_grad, "now": args.now}

    def describe(self, args):
        return "cleanup" + (" --zero-grad" if args.zero_grad else "")

    def render(self, session, target, action, prefix):
        r = action.get("result") or {}
        if action["state"] != "done":
            return
        b, a = r.get("before", {}), r.get("after", {})
        parts = [f"{k} {_bytes(b.get(k))} -> {_bytes(a.get(k))}" for k in a if b.get(k) is not None]
        extra = f", gradients freed {_bytes(r['grad_bytes_freed'])}" if "grad_bytes_freed" in r else ""
        session.print(f"{prefix}gc collected {r.get('gc_collected')} objects; " + "; ".join(parts) + extra + ".")
