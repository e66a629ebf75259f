"""The audit log: one JSON object a line for every action and eval.

Written to ``audit.jsonl`` in the runtime directory (mode 0600): time, pid of the
target, client (uid for the unix socket, address for TCP), command, arguments and
outcome. Audit failures are recorded in ``probe.errors`` and never stop the action
from being reported.
"""

from __future__ import annotations

import json
import os
import threading
import time

from ..util.errorlog import record_error
from .._runtime import runtime_dir


_lock = threading.Lock()


def audit_path() -> str:
    return os.path.join(runtime_dir(), "audit.jsonl")


def audit(client: dict, command: str, args: dict | None, outcome: str, **extra) -> None:
    record = {
        "time": time.time(),
        "pid": os.getpid(),
        "client": client,
        "command": command,
        "args": args or {},
        "outcome": outcome,
    }
    record.update(extra)
    try:
        line = json.dumps(record, default=repr) + "\n"
        with _lock:
            fd = os.open(audit_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
    except Exception as exc:
        record_error("audit", exc)
