"""Attach to a Python process that never imported probe, or read its stacks without it.

``inject(pid)`` climbs the attach ladder (``sys.remote_exec`` on 3.14+, then gdb) to
start the probe server inside the process; ``pyspy_backtrace(pid)`` reads every
thread's stack read-only with py-spy, which also works on a process stuck in C with
the GIL held. Failures raise ``AttachError`` with one sentence and a distinct exit
code per cause (``EXIT_CODES``). This package never imports torch.
"""

from __future__ import annotations

from ._ladder import RUNGS, inject
from ._process import EXIT_CODES, ProcessInfo, inspect_process, ptrace_problem
from ._pyspy import pyspy_backtrace, pyspy_path, pyspy_record

__all__ = [
    "inject",
    "pyspy_backtrace",
    "pyspy_path",
    "pyspy_record",
    "inspect_process",
    "ptrace_problem",
    "ProcessInfo",
    "EXIT_CODES",
    "RUNGS",
]
