"""Everything that touches the training loop.

* ``hooks``: torch's optimizer step hooks, ``probe.step()`` and ``probe.watch()``; ``InputCounter``: micro-batches,
  samples and tokens counted at the primary model;
* ``steps``: the step tracker (quick or full boundary, the budget); ``steprows``: what a ``torch.steps`` row
  holds, device values read once landed, the memory clock, several optimizers per step;
* ``capture``: the loss and the gradient norm;
* ``finder`` and ``frameworks``: the one object finder; the framework adapters, FSDP2's shards and c10d's flight
  recorder;
* ``trace``: module tracing on sampled steps and ``torch.syncs``; ``tracecalls``: what a traced step's hooks
  record and the rows it writes;
* ``invariants``: the checks of ``torch.checks``; ``weights``: what the steps do to the weights (whether they
  move as they should, DDP replicas' checksums and configuration).

The step boundary they all pass (``boundary``, with ``Boundary`` and ``StepEvent``) lives in ``probe._core`` so
that every room can register with it; it is exported here for loops and tests that pass it by hand.
"""

from .._core.boundary import Boundary, StepEvent, boundary

__all__ = ["Boundary", "StepEvent", "boundary"]
