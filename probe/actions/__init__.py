"""Guarded actions: the safe-point queue (``queue``) and each action (checkpoint, lr,
eval, cleanup and debug)."""
