"""diagnosis.rules: the doctor's rules; diagnosis.findings: what they find.

A process serves only its script's own rules in ``diagnosis.rules``; the client adds the rules probe ships,
which live in the client (``probe.cli.doctor``) and are never loaded here.

``diagnosis.findings`` is declared here (so it is listed, described and completed like any
table) but computed by the client: the doctor runs in the probe CLI over the other tables
(``probe.cli.doctor``), never in the training process, whose own snapshot of it is empty.
"""

from __future__ import annotations

import json

from ..diagnosis.rules import all_rules
from .registry import Column, table


@table(
    "diagnosis.rules",
    "The doctor's rules: the ones probe ships and the training script's own (declared with probe.rule).",
    columns=[
        Column("name", "VARCHAR", "Rule name."),
        Column(
            "family",
            "VARCHAR",
            "Failure family: hang, nan, divergence, plateau, parameters, optimizer, memory, slow, input, distributed, "
            "probe.",
        ),
        Column("severity", "VARCHAR", "critical, warning or info."),
        Column(
            "scope", "VARCHAR", "process (runs on each process's tables) or job (reads the ranks.* views across ranks)."
        ),
        Column("description", "VARCHAR", "What the rule finds, in one sentence."),
        Column("sql", "VARCHAR", "The query whose rows are the findings."),
        Column("message", "VARCHAR", "Message template over the query's columns."),
        Column("next", "VARCHAR", "Next commands to run, as a JSON list of templates."),
        Column("params", "VARCHAR", "Placeholders in the SQL filled from settings, as JSON."),
        Column(
            "explains",
            "VARCHAR",
            "Rules whose findings are this one's consequences, as a JSON list: when both fire, the doctor folds them "
            "into this rule's finding.",
        ),
    ],
    examples=["SELECT name, family, severity, description FROM diagnosis.rules ORDER BY family, name"],
)
def rules(ctx):
    return [
        (
            r.name,
            r.family,
            r.severity,
            r.scope,
            r.description,
            r.sql,
            r.message,
            json.dumps(list(r.next)),
            json.dumps(dict(r.params)),
            json.dumps(list(r.explains)),
        )
        for r in all_rules()
    ]


FINDING_COLUMNS = [
    Column(
        "rule",
        "VARCHAR",
        "Name of the rule that found it (a row of diagnosis.rules), or not_answering for a process that did not "
        "answer.",
    ),
    Column("family", "VARCHAR", "Failure family of the rule (hang, nan, divergence, distributed, ...)."),
    Column("severity", "VARCHAR", "critical, warning or info."),
    Column("rank", "INTEGER", "Rank the finding is about, NULL outside a distributed job."),
    Column(
        "step",
        "BIGINT",
        "Step the finding is about (where the loss went NaN, the last step of a window), NULL when none.",
    ),
    Column("message", "VARCHAR", "The finding in one sentence, with the numbers that prove it."),
    Column("evidence", "VARCHAR", "The rule's result row as a JSON object (json_extract reads it)."),
    Column("next", "VARCHAR", "Next commands to run, as a JSON list."),
    Column("target", "VARCHAR", "What to type after probe to reach the process (a pid, or --rank N)."),
]


@table(
    "diagnosis.findings",
    "What probe doctor finds now: one row per finding of its rules, most severe first, the same as `probe doctor` "
    "prints.",
    columns=FINDING_COLUMNS,
    examples=[
        "SELECT severity, rule, rank, step, message FROM diagnosis.findings",
        "SELECT rule, json_extract_string(evidence, '$.cause') AS cause FROM diagnosis.findings WHERE family = 'nan'",
    ],
    kind="client",
)
def findings(ctx):
    return []  # the doctor runs in the client (probe.cli.doctor), never in the training process
