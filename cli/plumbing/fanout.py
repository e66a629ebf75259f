"""Fan-out to several ranks: concurrent requests, per-rank errors, partial results.

Every rank is asked on a thread pool with the per-rank timeout (``--timeout``). A rank
that is dead or silent becomes an error row naming it while the others still answer;
the command then exits with ``PARTIAL_EXIT`` (7) so scripts can tell a partial answer
from a complete one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from probe._errors import EndpointError, PartialError, ProbeError
from probe.util.procfs import proc_state


MAX_WORKERS = 64


@dataclass
class Answer:
    """One rank's answer: ``value`` or ``error`` (a one-sentence reason)."""

    target: Any
    value: Any = None
    error: str | None = None

    @property
    def rank(self):
        return self.target.rank

    @property
    def ok(self) -> bool:
        return self.error is None


def format_ranks(ranks) -> str:
    """Compress rank numbers into ranges.

    >>> format_ranks([0, 1, 2, 3, 5, 7, 8])
    'ranks 0-3,5,7-8'
    >>> format_ranks([4])
    'rank 4'
    """
    ranks = sorted(r for r in ranks if r is not None)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def rank_error(target, exc: ProbeError) -> str:
    """Why a rank did not answer, with what is known locally (stopped, gone)."""
    pid = target.local_pid
    if pid is not None:
        state = proc_state(pid)
        if state in ("T", "t"):
            return f"process {pid} is stopped (SIGSTOP or a debugger); `kill -CONT {pid}` resumes it"
        if state is None or state == "Z":
            return f"process {pid} has exited; the rank is gone"
    return exc.message.rstrip(".")


def parallel(items: list, fn: Callable, workers: int = MAX_WORKERS) -> list:
    """``[fn(item) for item in items]``, run concurrently on one bounded thread pool, in item order.

    The one thread pool of the CLI: every command that talks to several processes goes
    through here (directly, or through ``fan_out`` for per-rank answers).
    """
    if not items:
        return []
    if len(items) == 1:
        return [fn(items[0])]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as pool:
        return list(pool.map(fn, items))


def fan_out(items: list, fn: Callable, workers: int = MAX_WORKERS, target_of: Callable | None = None) -> list[Answer]:
    """Call ``fn(item)`` for every item concurrently; errors become Answer.error, in item order.

    ``target_of(item)`` names the Target of an item (default: the item is the Target).
    A local rank stopped by a signal fails at once instead of running into the timeout.
    """
    target_of = target_of or (lambda item: item)

    def one(item):
        target = target_of(item)
        if target.local_pid is not None and proc_state(target.local_pid) in ("T", "t"):
            return Answer(target, error=rank_error(target, ProbeError("stopped")))
        try:
            return Answer(target, fn(item))
        except ProbeError as exc:
            return Answer(target, error=rank_error(target, exc))
        except Exception as exc:  # a bug or an odd answer from one rank must not sink the others
            return Answer(target, error=f"{type(exc).__name__}: {exc}")

    return parallel(items, one, workers)


def _errors_text(failed: list[Answer]) -> str:
    return "; ".join(f"{a.target.label}: {a.error}" for a in failed)


def check_partial(answers: list[Answer], what: str) -> None:
    """Raise when every rank failed (EndpointError) or some did (PartialError)."""
    failed = [a for a in answers if not a.ok]
    if not failed:
        return
    if len(failed) == len(answers):
        raise EndpointError(f"no rank answered the {what}: {_errors_text(failed)}.")
    raise PartialError(
        f"{len(failed)} of {len(answers)} ranks did not answer the {what}, the output above is partial: "
        f"{_errors_text(failed)}."
    )
