"""``import probe.auto`` starts the probe server in this process (idempotent)."""

from .agent.lifecycle import start as _start

_start()
