"""Everything that touches the training loop: the step boundary (``safepoint``), finding
the training objects, the torch hooks, step bookkeeping and module tracing."""
