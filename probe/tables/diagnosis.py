"""diagnosis.rules: the doctor's rules known to this process, built-in and the script's own."""

from __future__ import annotations

import json

from ..diagnosis import builtin  # noqa: F401  (declares the built-in rules)
from ..diagnosis.rules import all_rules
from .registry import Column, table


@table(
    "diagnosis.rules",
    "The doctor's rules declared in this process (built-in and the training script's own, via probe.rule).",
    columns=[
        Column("name", "VARCHAR", "Rule name."),
        Column("family", "VARCHAR", "Failure family: hang, nan, divergence, plateau, parameters, optimizer, memory, slow, input, distributed, probe."),
        Column("severity", "VARCHAR", "critical, warning or info."),
        Column("scope", "VARCHAR", "process (runs on each process's tables) or job (reads the ranks.* views across ranks)."),
        Column("description", "VARCHAR", "What the rule finds, in one sentence."),
        Column("sql", "VARCHAR", "The query whose rows are the findings."),
        Column("message", "VARCHAR", "Message template over the query's columns."),
        Column("next", "VARCHAR", "Next commands to run, as a JSON list of templates."),
        Column("params", "VARCHAR", "Placeholders in the SQL filled from settings, as JSON."),
    ],
    examples=["SELECT name, family, severity, description FROM diagnosis.rules ORDER BY family, name"],
)
def rules(ctx):
    return [(r.name, r.family, r.severity, r.scope, r.description, r.sql, r.message, json.dumps(list(r.next)),
             json.dumps(dict(r.params))) for r in all_rules()]
