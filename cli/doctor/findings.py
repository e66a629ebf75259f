"""A finding of the doctor and what it is made of: the rule's message and next commands filled from one row of
its SQL, and the folding of findings that another one explains.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field

from probe.diagnosis.rules import SEVERITIES


@dataclass
class Finding:
    rule: str
    family: str
    severity: str
    message: str
    rank: int | None = None
    step: int | None = None
    target: str | None = None
    evidence: dict = field(default_factory=dict)
    next: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "family": self.family,
            "severity": self.severity,
            "rank": self.rank,
            "step": self.step,
            "target": self.target,
            "message": self.message,
            "evidence": self.evidence,
            "next": self.next,
        }

    def to_row(self) -> dict:
        """The finding as a row of ``diagnosis.findings`` (evidence and next as JSON text)."""
        return dict(self.to_dict(), evidence=json.dumps(self.evidence, default=str), next=json.dumps(self.next))


@dataclass
class Diagnosis:
    findings: list
    processes: int
    answering: int
    rules_run: int
    rules_skipped: list
    elapsed: float
    lacking: str = "the process does not have"  # who lacks a table a skipped rule reads (see skipped_lines)

    @property
    def worst(self) -> str | None:
        return min((f.severity for f in self.findings), key=SEVERITIES.index, default=None)

    def skipped_lines(self) -> list:
        """The rules that could not run, one line each, except those that read a table the process (or its
        post-mortem record) lacks: one line for all of them, naming the tables."""
        tables = list(dict.fromkeys(s["table"] for s in self.rules_skipped if s.get("table")))
        lines = [f"{s['rule']}: {s['why']}" for s in self.rules_skipped if not s.get("table")]
        if tables:
            n = sum(1 for s in self.rules_skipped if s.get("table"))
            lines.append(
                f"{n} rule{'s' if n != 1 else ''} read tables {self.lacking}: {', '.join(sorted(tables))} "
                "(--format json names each rule)."
            )
        return lines

    def to_dict(self) -> dict:
        return {
            "findings": [f.to_dict() for f in self.findings],
            "processes": self.processes,
            "answering": self.answering,
            "rules_run": self.rules_run,
            "rules_skipped": self.rules_skipped,
            "elapsed_s": round(self.elapsed, 3),
        }


def next_commands(templates, row: dict) -> list:
    """The rule's next commands for ``row``; one that names a ``next_*`` column whose value is NULL or
    empty is left out (a rule's SQL says which commands fit what it found).

    >>> next_commands(["probe {target} backtrace", "probe {target} {next_lr}"], {"target": "42", "next_lr": None})
    ['probe 42 backtrace']
    """
    out = []
    for t in templates:
        names = [name for _, name, _, _ in string.Formatter().parse(t) if name]
        if any(n.startswith("next_") and row.get(n) in (None, "") for n in names):
            continue
        out.append(fill_message(t, row))
    return out


def fill_message(template: str, row: dict) -> str:
    """The rule's template with the row's values; a missing, NULL or ill-fitting value prints as '?'.

    Each field is formatted on its own, so one value that does not fit its format spec
    (a NULL where ``{ratio:.2f}`` expects a number) costs that field, never the finding.

    >>> fill_message("{a:.2f} of {b} ({c:.0%})", {"a": 1.234, "b": None})
    '1.23 of ? (?)'
    """
    out = []
    for literal, name, spec, conv in string.Formatter().parse(template):
        out.append(literal)
        if name is None:
            continue
        value = row.get(name)
        if value is None:
            out.append("?")
            continue
        try:
            if conv:
                value = {"r": repr, "s": str, "a": ascii}[conv](value)
            out.append(format(value, spec))
        except (ValueError, TypeError, KeyError):
            out.append(str(value))
    return "".join(out)


def fold(findings: list, explains: dict) -> list:
    """Fold the findings a rule explains into that rule's finding: a job whose ranks all wait in mismatched
    collectives is one finding, not one more per rank that no step completes on. The folded ones are named at
    the end of its message and kept whole in its evidence (``explains``).

    >>> cause = Finding("collective_mismatch", "distributed", "critical", "rank 1 left the path.")
    >>> hung = [Finding("hung", "hang", "critical", "no step for 70 s.", rank=r) for r in (0, 1, 2)]
    >>> other = Finding("loss_spike", "divergence", "warning", "a spike.", rank=0)
    >>> [f.rule for f in fold([cause, *hung, other], {"collective_mismatch": ("hung",)})]
    ['collective_mismatch', 'loss_spike']
    >>> cause.message
    'rank 1 left the path. It explains: hung on ranks 0, 1, 2.'
    """
    causes = [f for f in findings if explains.get(f.rule)]
    if not causes:
        return findings
    folded: set = set()
    for cause in causes:
        effects = [f for f in findings if f.rule in explains[cause.rule] and f is not cause and id(f) not in folded]
        if not effects:
            continue
        folded.update(id(f) for f in effects)
        said = []
        for rule in dict.fromkeys(f.rule for f in effects):
            ranks = sorted({f.rank for f in effects if f.rule == rule and f.rank is not None})
            said.append(
                rule + (f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "")
            )
        cause.message += f" It explains: {'; '.join(said)}."
        cause.evidence = dict(cause.evidence, explains=[f.to_dict() for f in effects])
    return [f for f in findings if id(f) not in folded]
