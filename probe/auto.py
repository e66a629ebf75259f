"""``import probe.auto`` starts the probe server in this process (idempotent)."""

from ._agent import start as _start

_start()
