"""probe: live-attach debugging for running PyTorch training jobs.

``import probe`` has no side effects; ``import probe.auto`` (or ``PROBE=1``) starts
the in-process server. See the README for the CLI and docs/reference.md for the tables.

Public names are resolved lazily (PEP 562), so the CLI, which needs only the error
classes, does not pay for the server, table or torch-hook modules at start-up.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from ._errors import ActionError, AttachError, AuthError, EndpointError, ProbeError, QueryError  # noqa: E402

_LAZY = {
    "start": "agent.lifecycle",
    "stop": "agent.lifecycle",
    "is_running": "agent.lifecycle",
    "info": "_core.state",
    "step": "training.hooks",
    "watch": "training.hooks",
    "span": "_core.spans",
    "load_checkpoint": "actions.checkpoint",
    "load_evidence": "actions.evidence",
    "table": "tables.registry",
    "Column": "tables.registry",
    "rule": "diagnosis.rules",
}

__all__ = [
    "__version__",
    "start",
    "stop",
    "is_running",
    "info",
    "step",
    "watch",
    "span",
    "load_checkpoint",
    "load_evidence",
    "table",
    "Column",
    "rule",
    "ProbeError",
    "QueryError",
    "EndpointError",
    "AuthError",
    "ActionError",
    "AttachError",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'probe' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
