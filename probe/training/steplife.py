"""The step tracker's life outside its loop's steps: its status, and closing and reopening it around a pause."""

from __future__ import annotations

import time

from . import invariants, signals

__all__ = ["StepLife"]


class StepLife:
    """``StepTracker``'s base class: its methods that run outside the training loop's steps (``probe status``,
    ``hooks.pause`` and ``hooks.resume``), on the state ``StepTracker.__init__`` sets."""

    def last_end_wall(self) -> float | None:
        """Wall-clock time of the last boundary (None before the first)."""
        return None if self._last_ns is None else self._last_ns * 1e-9 + self.wall_offset

    # -- status -------------------------------------------------------------------------------------
    def status(self) -> dict:
        if self.step == 0:
            return {"state": "idle"}
        import numpy as np

        recent = self.ring.snapshot()
        # the last 20 steps' median; step 1's row times its work from the first module call only, not a whole step
        # (its data wait, and whatever the loop does after the optimizer, are not in it), so it is left out
        whole = np.asarray(recent["duration"][-20:])[np.asarray(recent["step"][-20:]) > 1]
        return {
            "step": self.step,
            "last_step_at": self.last_end_wall(),
            "step_time": float(np.median(whole)) if len(whole) else None,
            "state": "training",
        }

    def close(self) -> None:
        self.capture.unwrap()
        self.inputs.close()
        self.memory.stop()
        checks = invariants.checks()
        if checks is not None:  # its gradient hook too: a paused probe runs nothing on the loop's steps
            checks.close()
        sig = signals.signals()  # and the update being measured (the step pre-hook's)
        if sig is not None:
            sig.close()

    def reopen(self) -> None:
        """Undo ``close``: the loss and clip wrappers and the root model's hook go back; the next step's clock
        restarts."""
        self.capture.wrap()
        self.watch_roots()
        self._last_ns = None
        self._settled_ns = None  # the paused time earns nothing
        self.full_next()
        self._started_ns = now = time.perf_counter_ns()
        # nor does it count towards the budget's floor (a measured step at least once a second of probed training):
        # counted, a benchmark pausing two blocks in three would measure a step at every resume past a second,
        # three times as often per probed step as a job that never pauses
        self.budget.last_allowed_ns = now
