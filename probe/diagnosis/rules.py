"""The rule registry: one declaration per rule, the single source for the doctor and its docs.

In a training process it holds the script's own rules (``probe.rule``), which the ``diagnosis.rules`` table
serves; the rules probe ships are declared the same way in the client (``probe.cli.doctor``), which loads them
into its own registry and never into the training process.

A rule is data (docs/doctor.md, "Your own rules", shows one): every row its SQL returns is one finding, and
``message`` and each ``next`` entry are ``str.format`` templates over the row's columns plus ``target``.
``{name}`` placeholders in the SQL itself are filled from ``params`` (e.g. a threshold from a setting) before
it runs. Scope ``process`` rules run on each process's own tables (with a ``rank`` column across ranks);
``job`` rules read the ``ranks.*`` views and run only across several ranks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


SEVERITIES = ("critical", "warning", "info")  # most severe first
FAMILIES = (
    "hang",
    "crash",
    "nan",
    "divergence",
    "plateau",
    "parameters",
    "activations",
    "optimizer",
    "memory",
    "slow",
    "input",
    "distributed",
    "probe",
)
SCOPES = ("process", "job")

_REGISTRY: dict[str, "Rule"] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Rule:
    name: str
    family: str
    severity: str
    description: str
    sql: str
    message: str
    next: tuple[str, ...] = ()
    scope: str = "process"
    params: tuple[tuple[str, str], ...] = ()  # (placeholder, setting name) pairs filled before the SQL runs
    explains: tuple[str, ...] = ()  # rules whose findings are this one's consequences: folded into it when both fire

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return dict(d, next=list(self.next), params=dict(self.params), explains=list(self.explains))

    @classmethod
    def from_dict(cls, d: dict) -> "Rule":
        return cls(
            *(d[f.name] for f in fields(cls)[:6]),  # name to message: required
            tuple(d.get("next") or ()),
            d.get("scope") or "process",
            tuple((d.get("params") or {}).items()),
            tuple(d.get("explains") or ()),
        )


def rule(
    name: str,
    *,
    family: str,
    severity: str,
    description: str,
    sql: str,
    message: str,
    next: list[str] | tuple[str, ...] = (),
    scope: str = "process",
    params: dict | None = None,
    explains: list[str] | tuple[str, ...] = (),
) -> Rule:
    """Declare (or replace) a doctor rule; returns it. Raises ValueError on a malformed declaration."""
    if not name.replace("_", "").isalnum() or not name[0].isalpha():
        raise ValueError(f"rule name {name!r} must be letters, digits and underscores, starting with a letter")
    if family not in FAMILIES:
        raise ValueError(f"rule {name}: family must be one of {', '.join(FAMILIES)}, not {family!r}")
    if severity not in SEVERITIES:
        raise ValueError(f"rule {name}: severity must be one of {', '.join(SEVERITIES)}, not {severity!r}")
    if scope not in SCOPES:
        raise ValueError(f"rule {name}: scope must be process or job, not {scope!r}")
    if not description.endswith("."):
        raise ValueError(f"rule {name}: its description must be a sentence ending in a period")
    r = Rule(
        name,
        family,
        severity,
        description,
        sql.strip(),
        message,
        tuple(next),
        scope,
        tuple((params or {}).items()),
        tuple(explains),
    )
    with _LOCK:
        _REGISTRY[name] = r
    return r


def all_rules() -> list[Rule]:
    """The rules declared in this process, most severe first."""
    with _LOCK:
        return sorted(_REGISTRY.values(), key=lambda r: (SEVERITIES.index(r.severity), r.family, r.name))


def get_rule(name: str) -> Rule | None:
    return _REGISTRY.get(name)
