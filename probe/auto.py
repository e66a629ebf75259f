"""``import probe.auto`` starts the probe server in this process (idempotent).

It never raises into the training script: if the probe cannot start, one line on
stderr says why and the script goes on without it.
"""


def _start_quietly() -> None:
    try:
        from .agent.lifecycle import start

        start()
    except Exception as exc:
        import sys

        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        print(
            f"[probe] the probe did not start ({message.rstrip('.')}); training goes on without it.",
            file=sys.stderr,
            flush=True,
        )


_start_quietly()
