"""The doctor's built-in rules, one declaration each: ``process_rules`` (one process's training),
``runtime_rules`` (its memory, speed, input and activations), ``invariant_rules`` (the invariant checks
of torch.checks) and ``job_rules`` (across ranks,
dead ranks) and ``ddp_rules`` (DDP: replicas compared across ranks, its set-up, collectives that do not
match). Importing this module registers them all, in the order docs/doctor.md and docs/reference.md list them.
"""

from __future__ import annotations

from . import process_rules  # noqa: F401  (first: the registration order is the listing order)
from . import runtime_rules  # noqa: F401
from . import invariant_rules  # noqa: F401
from . import job_rules  # noqa: F401
from . import ddp_rules  # noqa: F401

__all__: list = []
