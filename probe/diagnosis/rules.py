"""The rule registry: one declaration per rule, the single source for the doctor and its docs.

A rule is data::

    rule("lr_zero", family="optimizer", severity="warning",
         description="An optimizer param group has learning rate 0: its parameters never move.",
         sql="SELECT optimizer, param_group, lr FROM torch.optimizer WHERE lr = 0",
         message="{optimizer} param group {param_group} has lr 0.",
         next=["probe {target} lr --set 1e-4 --group {param_group}"])

Every row the SQL returns is one finding. ``message`` and each ``next`` entry are
``str.format`` templates over the row's columns plus ``target`` (what to type after
``probe`` to reach that process). A ``rank`` or ``step`` column, when the SQL returns
one, says where the finding is. A ``next`` entry that names a ``next_*`` column is left
out when that column is NULL or empty: the SQL chooses the commands that fit what it found
(no ``lr --scale`` when the weights are already NaN). ``{name}`` placeholders in the SQL itself are filled
from ``params`` (e.g. a threshold from a setting) before it runs. Scope ``process`` rules
run on each process's own tables (with a ``rank`` column across ranks); ``job`` rules
read the ``ranks.*`` views and run only across several ranks.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

__all__ = ["Rule", "rule", "all_rules", "get_rule", "load_builtins", "BUILTIN", "SEVERITIES", "FAMILIES"]

# the modules of probe.diagnosis that declare the built-in rules, in the order docs/doctor.md and the
# README list them: one process's training, its memory/speed/input/activations, the invariant checks
# of torch.checks, and across ranks (dead ranks); all_rules()/get_rule() import them on first use
BUILTIN = ("process_rules", "param_rules", "runtime_rules", "invariant_rules", "signal_rules", "job_rules", "ddp_rules")

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
        return {
            "name": self.name,
            "family": self.family,
            "severity": self.severity,
            "description": self.description,
            "sql": self.sql,
            "message": self.message,
            "next": list(self.next),
            "scope": self.scope,
            "params": dict(self.params),
            "explains": list(self.explains),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Rule":
        return cls(
            d["name"],
            d["family"],
            d["severity"],
            d["description"],
            d["sql"],
            d["message"],
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


_LOADED: list[bool] = []


def load_builtins() -> None:
    """Import the built-in rules' modules (once; each declares its rules with ``rule(...)``)."""
    if _LOADED:
        return
    for mod in BUILTIN:
        importlib.import_module(f"{__package__}.{mod}")
    _LOADED.append(True)


def all_rules() -> list[Rule]:
    load_builtins()
    with _LOCK:
        return sorted(_REGISTRY.values(), key=lambda r: (SEVERITIES.index(r.severity), r.family, r.name))


def get_rule(name: str) -> Rule | None:
    load_builtins()
    return _REGISTRY.get(name)
