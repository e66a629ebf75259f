"""The ``ranks.*`` views: what every rank says about itself, lined up, and the one classification of rank states.

Two kinds of view (``sql.federate`` plans them):

* ``FEDERATED_VIEWS``: SQL each rank answers about itself on its own clock (one row per
  rank for ``ranks.latest``; the recent collectives for ``ranks.issued``).
* ``CLIENT_VIEWS``: SQL over the federated views and tables, run where the answers
  are unioned. ``ranks.status`` is the single classification of rank states:
  ``probe status`` prints it and ``ranks.hung``/``ranks.stragglers`` select from it,
  so they cannot disagree.

Their columns, each with its type and description, are declared in ``rank_columns``.

A rank is classified (first match wins: hung, then waiting or stalled, then dead or unreachable, then slow,
then training or idle) from torch's flight recorder (``torch.process_groups``, ``torch.collectives``) rather
than from Python stacks; ``culprit`` is true for the rank the others wait for. docs/ranks.md's table of states
says what each one means, and "How the culprit is found" how the collectives are lined up by (pg, seq).
"""

from __future__ import annotations

from probe.config import setting


PARAM_SETTINGS = {
    "straggler_factor": "PROBE_STRAGGLER_FACTOR",
    "hung_after": "PROBE_HUNG_AFTER",
    "desync_steps": "PROBE_DESYNC_STEPS",
}

_RECENT_STEPS = 20  # steps the per-rank medians look at
_PACE_STEPS = 200  # steps the per-rank p99 (the job's pace) looks at, 20 at least
# A rank is stalled after STALL_PACE times the job's p99 step time without a step, STALL_MIN_S at least: a job of
# 10 ms steps stalls long before PROBE_HUNG_AFTER; one of 30 s steps waits 50 x 30 s.
STALL_PACE = 50
STALL_MIN_S = 10
_RECENT_COLLECTIVES = 256  # collectives per rank compared for mismatches

# Per-rank: computed on the rank's own clock (no clock skew between hosts). The step-time medians leave out step 1,
# which runs from its first module call only (torch.steps.duration).
FEDERATED_VIEWS = {
    "ranks.latest": f"""
WITH recent AS (SELECT duration, compute, comm_wait FROM torch.steps WHERE step > 1 ORDER BY step DESC
                LIMIT {_RECENT_STEPS}),
s AS (SELECT max(step) AS step, max(ended_at) AS last_step_at, epoch(current_timestamp) - epoch(max(ended_at)) AS age_s,
             count(*) AS steps_seen FROM torch.steps),
r AS (SELECT median(duration) AS step_time,
             median(compute) FILTER (WHERE NOT isnan(compute)) AS compute,
             median(comm_wait) FILTER (WHERE NOT isnan(comm_wait)) AS comm_wait,
             sum(comm_wait) FILTER (WHERE NOT isnan(comm_wait))
               / nullif(sum(duration) FILTER (WHERE NOT isnan(comm_wait)), 0) AS wait_share FROM recent),
pace AS (SELECT CASE WHEN count(*) >= 20 THEN quantile_cont(duration, 0.99) END AS p99
         FROM (SELECT duration FROM torch.steps WHERE step > 1 AND duration IS NOT NULL ORDER BY step DESC
               LIMIT {_PACE_STEPS})),
b AS (SELECT any_value(func || ' (' || regexp_replace(file, '.*/', '') || ':' || lineno || ')') FILTER (WHERE depth = 0)
               AS top_frame,
             coalesce(bool_or(file LIKE '%torch/distributed/%'), false) AS in_distributed
      FROM python.backtrace WHERE is_main),
g AS (SELECT count(*) > 0 AS recorder, coalesce(sum(pending), 0) > 0 AS pending FROM torch.process_groups),
p AS (SELECT pg, pending_seq, pending_op, pending_sizes, pending_s FROM torch.process_groups
      WHERE pending > 0 ORDER BY pending_s DESC LIMIT 1)
SELECT i.pid, i.host, s.step, s.last_step_at, s.age_s, r.step_time, s.steps_seen, i.state, i.hung_since, b.top_frame,
       CASE WHEN g.recorder THEN g.pending ELSE b.in_distributed END AS in_collective, g.recorder,
       r.compute, r.comm_wait, r.wait_share,
       p.pg AS pending_pg, p.pending_seq, p.pending_op, p.pending_sizes, p.pending_s,
       i.source, i.exit_cause, i.exit_reason, pace.p99, i.main_state
FROM process.info AS i, s, r, pace, b, g LEFT JOIN p ON TRUE""",
    "ranks.issued": f"""
SELECT pg, seq, op, input_sizes, input_dtypes, created_at, step
FROM torch.collectives WHERE seq IS NOT NULL ORDER BY record_id DESC LIMIT {_RECENT_COLLECTIVES}""",
}


def ranks_phrase(ranks: str, one: str = "", many: str | None = None) -> str:
    """SQL naming the ranks of ``ranks`` (an expression: a comma-separated list such as ``'0,2'``) in words that
    agree with their number, followed by ``one`` for a single rank and ``many`` (default ``one``) for several;
    NULL when ``ranks`` is NULL. Every message that names a list of ranks says it this way.

    >>> ranks_phrase("w", " waits", " wait")
    "CASE WHEN strpos(w, ',') > 0 THEN 'ranks ' || w || ' wait' ELSE 'rank ' || w || ' waits' END"
    """
    many = one if many is None else many

    def tail(words: str) -> str:
        return f" || '{words}'" if words else ""

    return (
        f"CASE WHEN strpos({ranks}, ',') > 0 THEN 'ranks ' || {ranks}{tail(many)} "
        f"ELSE 'rank ' || {ranks}{tail(one)} END"
    )


_WAIT_FOR_IT = ranks_phrase("coalesce(waited_by, (SELECT ranks FROM w), '?')", " waits for it", " wait for it")
_CULPRITS = "(SELECT string_agg(CAST(o.rank AS VARCHAR), ',' ORDER BY o.rank) FROM s AS o WHERE o.is_culprit)"

CLIENT_VIEWS = {
    # per (process group, rank): where each rank stands, who waits for whom, and mismatches
    "ranks.collectives": """
WITH silent AS (SELECT rank FROM ranks.latest WHERE state IN ('stopped', 'unreachable', 'dead')),
-- a dead rank's recorder (from its post-mortem record) says where it stood when it died, not where it waits now
g AS (SELECT rank, pg, pg_desc, last_enqueued, last_completed, pending, pending_seq, pending_op, pending_sizes,
             pending_dtypes, pending_s, pending_site FROM torch.process_groups
      WHERE rank NOT IN (SELECT rank FROM ranks.latest WHERE state = 'dead')),
waiting AS (SELECT * FROM g WHERE pending_s > {hung_after}),
stalled AS (SELECT rank FROM (SELECT rank FROM waiting UNION SELECT rank FROM ranks.latest WHERE age_s > {hung_after})
            WHERE rank NOT IN (SELECT rank FROM silent)),
issued AS (SELECT rank, pg, seq, op || ' ' || input_sizes || ' ' || input_dtypes AS what FROM ranks.issued),
kinds AS (SELECT pg, seq, what, count(*) AS n FROM issued GROUP BY ALL),
split AS (SELECT pg, seq, max(n) AS top, count(*) FILTER (WHERE n = (SELECT max(n) FROM kinds AS x
                                                               WHERE x.pg = kinds.pg AND x.seq = kinds.seq)) AS tops
          FROM kinds GROUP BY ALL HAVING count(*) > 1),
odd AS (SELECT i.rank, i.pg, min(i.seq) AS seq FROM issued i JOIN split p ON i.pg = p.pg AND i.seq = p.seq
        JOIN kinds k ON k.pg = i.pg AND k.seq = i.seq AND k.what = i.what
        WHERE k.n < p.top OR p.tops > 1 GROUP BY ALL)
SELECT g.rank, g.pg, g.pg_desc, g.last_enqueued, g.last_completed,
       max(g.last_enqueued) OVER (PARTITION BY g.pg) - g.last_enqueued AS behind,
       g.pending, g.pending_seq, g.pending_op, g.pending_sizes, g.pending_s, g.pending_site,
       CASE WHEN g.pending_s > {hung_after} THEN 'waiting'
            -- a silent rank is the culprit when there is one: after a peer dies, the survivors' failed collectives
            -- may be left unfinished at different seqs, which says nothing about who is behind
            WHEN NOT EXISTS (SELECT 1 FROM silent) AND EXISTS (SELECT 1 FROM waiting w WHERE w.pg = g.pg
                 AND w.pending_seq > coalesce(g.last_enqueued, -1))
            THEN 'culprit' ELSE 'ok' END AS role,
       CASE WHEN g.pending_s > {hung_after} THEN
            (SELECT string_agg(CAST(r AS VARCHAR), ',' ORDER BY r) FROM
                (SELECT o.rank AS r FROM g AS o WHERE o.pg = g.pg AND coalesce(o.last_enqueued, -1) < g.pending_seq
                 UNION SELECT rank FROM silent)) END AS waits_for,
       (SELECT string_agg(CAST(w.rank AS VARCHAR), ',' ORDER BY w.rank) FROM waiting w
        WHERE w.pg = g.pg AND w.pending_seq > coalesce(g.last_enqueued, -1) AND NOT EXISTS (SELECT 1 FROM silent))
           AS waited_by,
       (SELECT 'seq ' || o.seq || ': ' || any_value(i.what) || ' here, '
               || string_agg(DISTINCT x.what || ' on rank ' || x.rank, ', ')
        FROM odd o JOIN issued i ON i.rank = o.rank AND i.pg = o.pg AND i.seq = o.seq
        JOIN issued x ON x.pg = o.pg AND x.seq = o.seq AND x.what <> i.what
        WHERE o.rank = g.rank AND o.pg = g.pg GROUP BY o.seq) AS mismatch
FROM g
UNION ALL
SELECT s.rank, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       CASE WHEN EXISTS (SELECT 1 FROM stalled) THEN 'culprit' ELSE 'silent' END, NULL,
       (SELECT string_agg(CAST(rank AS VARCHAR), ',' ORDER BY rank) FROM stalled), NULL
FROM silent AS s
ORDER BY rank, pg""",
    # the one classification of rank states (see the module docstring)
    "ranks.status": f"""
WITH job AS (SELECT max(p99) AS pace FROM ranks.latest WHERE state NOT IN ('stopped', 'unreachable', 'dead')),
l AS (SELECT x.*, coalesce(age_s > {{hung_after}}, false) OR state = 'hung' AS stalled,
             -- the job's own pace: no step for many times its p99 step time while its main thread does not run
             -- (one that runs computes, or waits for a CPU on a loaded host: slow, not stalled)
             coalesce(age_s > greatest({{stall_pace}} * job.pace, {{stall_min_s}}), false)
               AND main_state IS DISTINCT FROM 'running' AS paced,
             greatest({{stall_pace}} * job.pace, {{stall_min_s}}) AS stall_after, job.pace
      FROM ranks.latest AS x, job),
gone AS (SELECT string_agg(CAST(rank AS VARCHAR), ',' ORDER BY rank) AS ranks FROM l
         WHERE state IN ('stopped', 'unreachable', 'dead')),
c AS (SELECT rank, bool_or(role = 'culprit') AS culprit,
             any_value(waits_for) FILTER (WHERE role = 'waiting') AS waits_for,
             any_value(waited_by) FILTER (WHERE role = 'culprit') AS waited_by,
             any_value(mismatch) FILTER (WHERE mismatch IS NOT NULL) AS mismatch
      FROM ranks.collectives GROUP BY rank),
i AS (SELECT rank, pg, seq, step, created_at FROM ranks.issued WHERE step IS NOT NULL),
n AS (SELECT pg, count(DISTINCT rank) AS ranks FROM i GROUP BY pg),
everyone AS (SELECT i.pg, i.seq, max(i.created_at) AS latest FROM i JOIN n USING (pg)
             GROUP BY i.pg, i.seq, n.ranks HAVING n.ranks > 1 AND count(*) = n.ranks),
lag AS (SELECT i.rank, i.step, max(epoch_us(e.latest) - epoch_us(i.created_at)) / 1e6 AS wait
        FROM i JOIN everyone AS e USING (pg, seq) GROUP BY i.rank, i.step),
x AS (SELECT rank, median(wait) AS wait FROM lag
      WHERE step < (SELECT max(step) FROM lag AS o WHERE o.rank = lag.rank) GROUP BY rank),
k AS (SELECT l.rank,
             CASE WHEN x.wait IS NOT NULL THEN greatest(l.step_time - x.wait, 0) ELSE l.compute END AS compute,
             CASE WHEN x.wait IS NOT NULL THEN x.wait ELSE l.comm_wait END AS comm_wait,
             CASE WHEN x.wait IS NOT NULL THEN 'collectives' WHEN l.compute IS NOT NULL THEN 'steps'
                  ELSE 'step_time' END AS basis
      FROM l LEFT JOIN x USING (rank) WHERE l.state NOT IN ('stopped', 'unreachable', 'dead')),
kw AS (SELECT k.rank, k.compute, k.comm_wait, k.basis,
              CASE WHEN k.basis = 'step_time' THEN l.step_time ELSE k.compute END AS work
       FROM k JOIN l USING (rank)),
m AS (SELECT a.rank, a.work, a.basis, a.compute AS x_compute, a.comm_wait AS x_wait,
             (SELECT median(b.work) FROM kw AS b WHERE b.rank <> a.rank AND b.basis = a.basis) AS others FROM kw AS a),
v AS (SELECT l.* EXCLUDE (compute, comm_wait), m.x_compute AS compute, m.x_wait AS comm_wait,
             c.culprit, c.waits_for, c.waited_by, c.mismatch, m.work, m.basis, m.others,
             -- a stall in words: how long, against which pace
             'no step for ' || CAST(round(l.age_s, 1) AS VARCHAR) || ' s, '
               || CAST(CAST(round(l.age_s / l.pace) AS BIGINT) AS VARCHAR) || 'x the job''s p99 step time of '
               || CAST(round(l.pace * 1000, 1) AS VARCHAR) || ' ms, outside any collective' AS stall,
             CASE WHEN l.state = 'dead' THEN 'dead'
                  WHEN l.state = 'stopped' THEN 'hung'
                  WHEN l.state = 'unreachable' THEN 'unreachable'
                  -- inside a collective, or stalled while a peer is gone (its collective failed)
                  WHEN l.stalled AND (l.in_collective OR (SELECT ranks FROM gone) IS NOT NULL) THEN 'waiting'
                  WHEN l.stalled THEN 'hung'
                  WHEN l.paced AND (l.in_collective OR (SELECT ranks FROM gone) IS NOT NULL) THEN 'waiting'
                  WHEN l.paced THEN 'stalled'
                  WHEN m.work > {{straggler_factor}} * m.others THEN 'slow'
                  WHEN l.step IS NULL THEN 'idle'
                  ELSE 'training' END AS verdict
      FROM l LEFT JOIN c USING (rank) LEFT JOIN m USING (rank)),
w AS (SELECT string_agg(CAST(rank AS VARCHAR), ',' ORDER BY rank) AS ranks FROM v WHERE verdict = 'waiting'),
s AS (SELECT v.*, coalesce(v.culprit, false) OR v.verdict = 'hung'
                  OR (v.verdict IN ('unreachable', 'dead', 'stalled') AND (SELECT ranks FROM w) IS NOT NULL)
                  AS is_culprit FROM v)
SELECT rank, host, pid, step, age_s, step_time, compute, comm_wait, comm_wait / nullif(step_time, 0) AS wait_share,
       verdict AS state, is_culprit AS culprit,
       CASE WHEN verdict = 'dead' THEN
                 'died at step ' || coalesce(CAST(step AS VARCHAR), '?') || ' (' || coalesce(exit_cause, '?') || '): '
                 || coalesce(exit_reason, 'no record of how')
                 || CASE WHEN is_culprit THEN '; ' || {_WAIT_FOR_IT} ELSE '' END
            WHEN verdict = 'waiting' AND pending_op IS NULL THEN
                 'no step for ' || CAST(round(age_s, 1) AS VARCHAR) || ' s, outside any collective, while '
                 || {ranks_phrase("(SELECT ranks FROM gone)", " did not answer")}
                 || ': its collective with them failed or never came'
            WHEN verdict = 'waiting' THEN
                 'waits in ' || pending_op || ' seq ' || pending_seq
                 -- the collectives view names whom it waits for once pending_s passes hung_after; until then
                 -- (age_s passes it first) the culprits this view found
                 || coalesce(' for ' || {ranks_phrase("nullif(waits_for, '')")},
                             ' for ' || {ranks_phrase("(SELECT ranks FROM gone)")},
                             ' for ' || {ranks_phrase(_CULPRITS)}, '')
            WHEN is_culprit THEN
                 CASE WHEN verdict = 'unreachable' THEN 'did not answer (exited?); ' ELSE '' END
                 || {_WAIT_FOR_IT}
                 || CASE WHEN state = 'stopped' THEN ' (process stopped)'
                         WHEN verdict = 'stalled' THEN '; ' || stall
                         WHEN in_collective OR verdict <> 'hung' THEN ''
                         ELSE '; no step for ' || coalesce(CAST(round(age_s, 1) AS VARCHAR) || ' s', 'a while')
                              || ' outside any collective' END
            WHEN verdict = 'stalled' THEN stall
            WHEN verdict = 'hung' THEN 'no step for ' || coalesce(CAST(round(age_s, 1) AS VARCHAR) || ' s', 'a while')
                 || ' outside any collective'
            WHEN verdict = 'slow' THEN CASE basis WHEN 'step_time' THEN 'step time ' ELSE 'compute ' END
                 || CAST(round(work / others, 2) AS VARCHAR) || 'x the others'
            WHEN mismatch IS NOT NULL THEN 'collective mismatch at ' || mismatch
       END AS reason,
       mismatch, in_collective, pending_op, pending_seq, work, others, basis, top_frame, exit_cause, exit_reason,
       pace, stall_after
FROM s
ORDER BY rank""",
    "ranks.stragglers": """
SELECT rank, step, step_time, compute, comm_wait, others AS others_compute, work / others AS ratio, basis, top_frame
FROM ranks.status
WHERE state = 'slow'
ORDER BY ratio DESC""",
    # behind by more steps than the ranks' snapshot times explain: each rank answers at its own moment, so a
    # rank asked earlier has fewer steps; the steps the leader made since this rank's last step do not count
    "ranks.desync": """
WITH lead AS (SELECT max(step) AS top, arg_max(last_step_at, step) AS top_at FROM ranks.latest)
SELECT rank, step, behind FROM (
  SELECT l.rank, l.step, lead.top - l.step AS behind,
         coalesce(greatest(epoch(lead.top_at) - epoch(l.last_step_at), 0) / nullif(l.step_time, 0), 0) AS explained
  FROM ranks.latest AS l, lead
  WHERE l.state IS DISTINCT FROM 'dead')
WHERE behind > {desync_steps} AND behind - explained > {desync_steps} + 1
ORDER BY behind DESC, rank""",
    "ranks.hung": """
SELECT rank, step, age_s, state, culprit, in_collective, pending_op, pending_seq, reason, top_frame
FROM ranks.status
WHERE state IN ('hung', 'waiting') OR (culprit AND state IN ('unreachable', 'dead'))
ORDER BY culprit DESC, rank""",
}


def view_params(environ: dict | None = None, strict: bool = False) -> dict:
    """The client views' parameters from their typed settings (``environ={}``: the defaults)."""
    return {key: setting(name, environ, strict=strict) for key, name in PARAM_SETTINGS.items()}


def view_sql(name: str, params: dict | None = None) -> str:
    """The SQL of a client view with its parameters filled in.

    >>> "2.0 * m.others" in view_sql("ranks.status", {"straggler_factor": 2.0})
    True
    """
    values = dict(view_params({}), **(params or {}))
    clean = {k: float(v) for k, v in values.items()}
    return CLIENT_VIEWS[name].strip().format(**clean, stall_pace=STALL_PACE, stall_min_s=STALL_MIN_S)
