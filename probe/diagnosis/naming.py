"""SQL fragments that name parameter tensors by module, for the rules about parameters: a finding says
which tensors ("encoder.* (4 tensors, 20.5k elements)"), never only how many.

The tensors a rule is about are grouped under the largest module prefixes that hold nothing else; a tensor
whose module also holds tensors the rule is not about is named alone. Pure SQL over torch.parameters:
each tensor's dotted name gives every module path above it; a path is a group when all of its tensors
are hit and its parent's are not.
"""

from __future__ import annotations

__all__ = ["named", "human"]

_NAMES_SHOWN = 6  # groups a message lists before "and N more"


def human(x: str) -> str:
    """SQL for a count in a few characters: 20480 -> 20.5k."""
    return (
        f"CASE WHEN {x} >= 1e9 THEN printf('%.3gG', {x} / 1e9) WHEN {x} >= 1e6 THEN printf('%.3gM', {x} / 1e6) "
        f"WHEN {x} >= 1e4 THEN printf('%.3gk', {x} / 1e3) ELSE CAST({x} AS VARCHAR) END"
    )


def named(alias: str, hit: str, among: str = "TRUE") -> str:
    """CTEs ending in ``{alias}(rank, model, names, groups)``: the torch.parameters rows where ``hit`` holds
    (of those where ``among`` does), named by module prefix, largest first; ``names`` is 'all of its tensors'
    when all of the model's are hit."""
    return f"""
{alias}_t AS (SELECT rank, model, numel, coalesce({hit}, FALSE) AS hit, string_split(name, '.') AS parts
              FROM torch.parameters WHERE {among}),
{alias}_k AS (SELECT rank, model, numel, hit, len(parts) AS depth, parts, unnest(generate_series(1, len(parts))) AS k
              FROM {alias}_t),
{alias}_g AS (SELECT rank, model, array_to_string(list_slice(parts, 1, k), '.') AS prefix,
                     any_value(array_to_string(list_slice(parts, 1, k - 1), '.')) AS parent,
                     bool_and(hit) AS pure, count(*) AS tensors, sum(numel) AS elements,
                         any_value(array_to_string(parts, '.')) AS one
              FROM {alias}_k GROUP BY rank, model, prefix),
{alias}_m AS (SELECT g.rank, g.model, g.prefix, g.elements,
                     CASE WHEN g.tensors = 1 THEN g.one
                          ELSE g.prefix || '.* (' || g.tensors || ' tensors, ' || {human("g.elements")}
                              || ' elements)' END AS label
              FROM {alias}_g AS g
              LEFT JOIN {alias}_g AS up ON up.rank IS NOT DISTINCT FROM g.rank
                  AND up.model = g.model AND up.prefix = g.parent
              WHERE g.pure AND (up.pure IS NULL OR NOT up.pure)),
{alias}_l AS (SELECT rank, model, list(label ORDER BY elements DESC, prefix) AS labels
    FROM {alias}_m GROUP BY rank, model),
{alias}_all AS (SELECT rank, model, bool_and(hit) AS every FROM {alias}_t GROUP BY rank, model),
{alias} AS (SELECT l.rank, l.model, len(l.labels) AS groups,
                   CASE WHEN a.every THEN 'all of its tensors'
                        ELSE array_to_string(list_slice(l.labels, 1, {_NAMES_SHOWN}), ', ') ||
                             CASE WHEN len(l.labels) > {_NAMES_SHOWN} THEN ' and '
                                 || (len(l.labels) - {_NAMES_SHOWN}) || ' more'
                                  ELSE '' END END AS names
            FROM {alias}_l AS l JOIN {alias}_all AS a ON a.rank IS NOT DISTINCT FROM l.rank AND a.model = l.model)"""
