"""Sharded tensors (FSDP2, DTensor): what this rank holds, without a collective.

Under FSDP2 (``fully_shard``) parameters, gradients and optimizer state are DTensors. Any
reduction of a DTensor (``.sum()``, a norm, ``.item()``, ``.tolist()``) redistributes it: an
``all_reduce`` or ``all_gather`` issued on this rank alone, which the other ranks never match, and
the job hangs. The probe never issues a collective, so it reads the local shard
(``_local_tensor``, what ``DTensor.to_local()`` returns without communicating) and says that its
figures are this rank's.
"""

from __future__ import annotations

__all__ = ["is_sharded", "local", "placement"]


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (checked by its attributes: torch.distributed need not be imported)."""
    return getattr(t, "_local_tensor", None) is not None and hasattr(t, "placements")


def local(t):
    """The tensor this rank holds of ``t`` (itself when ``t`` is an ordinary tensor); never communicates."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None and hasattr(t, "placements") else t


def placement(t) -> str | None:
    """``Shard(dim=0)``-like text of a DTensor's placements (one per mesh dimension), None for an ordinary tensor."""
    if not is_sharded(t):
        return None
    try:
        return ",".join(str(p) for p in t.placements)
    except Exception:
        return "DTensor"
