"""probe: live-attach debugging for running PyTorch training jobs.

``import probe`` has no side effects; ``import probe.auto`` (or ``PROBE=1``) starts
the in-process server. See the README for the CLI and the table reference.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ._errors import ActionError, AttachError, AuthError, EndpointError, ProbeError, QueryError  # noqa: E402
from ._tables import Column, table  # noqa: E402
from ._agent import start, stop, is_running, info  # noqa: E402
from ._torch_hooks import step, watch  # noqa: E402

__all__ = [
    "__version__",
    "start",
    "stop",
    "is_running",
    "info",
    "step",
    "watch",
    "table",
    "Column",
    "ProbeError",
    "QueryError",
    "EndpointError",
    "AuthError",
    "ActionError",
    "AttachError",
]
