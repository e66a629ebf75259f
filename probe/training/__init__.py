"""Everything that touches the training loop.

* ``boundary``: the one step boundary and its registrations (``before_step``, ``after_step``, ``heartbeat``);
* ``hooks``: torch's optimizer step hooks, ``probe.step()`` and ``probe.watch()``;
* ``steps``: the step tracker (quick or full boundary, the budget); ``steprows``: what a ``torch.steps`` row
  holds, device values read once landed, the memory clock, several optimizers per step;
* ``capture``: the loss and the gradient norm; ``inputs``: micro-batches, samples and tokens;
* ``finder`` and ``frameworks``: the one object finder and the framework adapters (and FSDP2's shards);
* ``trace``, ``tracecalls``, ``traceout``: module tracing on sampled steps, and ``torch.syncs``;
* ``invariants`` and ``updates``: the checks of ``torch.checks``;
* ``replicas`` and ``collectives``: DDP weight checksums and the c10d flight recorder;
* ``spans``: ``probe.span``.
"""
