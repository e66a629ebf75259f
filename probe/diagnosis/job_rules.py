"""The doctor's rules across the ranks of a job and about ranks that died: the hang's culprit, the
straggler, desync, loss dispersion, and a rank's death (docs/doctor.md lists them).
"""

from __future__ import annotations

from probe.sql.ranks import STALL_MIN_S, STALL_PACE, ranks_phrase

from .rules import rule

__all__: list = []

rule(
    "hung_rank",
    family="distributed",
    severity="critical",
    scope="job",
    description=(
        "The rank the others wait for (ranks.status culprit): hung outside any collective, stopped, or gone while "
        "the others wait."
    ),
    # state <> 'dead': rank_died says it
    sql="SELECT rank, step, state, reason, top_frame FROM ranks.hung WHERE culprit AND state <> 'dead'",
    message="rank {rank} is the one the others wait for (state {state}): {reason}; now in {top_frame}.",
    next=[
        "probe --rank {rank} backtrace",
        "probe --rank {rank} backtrace --native",
        "probe --ranks all backtrace --group",
    ],
)

rule(
    "stalled_rank",
    family="distributed",
    severity="critical",
    scope="job",
    description=(
        f"A rank is stalled and the others wait for it (ranks.status: no step for {STALL_PACE}x the job's p99 step "
        f"time, {STALL_MIN_S} s at least, while its main thread does not run): they wait in a collective it has not "
        "issued (torch.process_groups, the flight recorder); named before PROBE_HUNG_AFTER, when hung_rank would."
    ),
    sql=f"""
WITH s AS (SELECT rank, step, age_s, pace, top_frame FROM ranks.status WHERE state = 'stalled' AND culprit),
w AS (SELECT g.rank, g.pg, g.pending_seq, g.pending_op, g.pending_s
      FROM torch.process_groups AS g JOIN ranks.status AS x ON x.rank = g.rank
      WHERE g.pending > 0 AND x.state = 'waiting'),
c AS (SELECT o.rank, o.pg, min(w.pending_seq) AS seq, any_value(w.pending_op) AS op, max(w.pending_s) AS waited_s,
             array_to_string(list_sort(list(DISTINCT w.rank)), ',') AS waiters
      FROM torch.process_groups AS o JOIN w ON w.pg = o.pg AND w.rank <> o.rank
      WHERE coalesce(o.last_enqueued, -1) < w.pending_seq AND o.rank IN (SELECT rank FROM s)
      GROUP BY o.rank, o.pg)
SELECT c.rank, s.step, c.pg, c.seq, c.op, c.waited_s, c.waiters,
       {ranks_phrase("c.waiters", " has waited", " have waited")} AS waited, s.pace * 1000 AS p99_ms,
       c.waited_s / s.pace AS ratio, coalesce(s.top_frame, 'an unknown frame') AS top_frame,
       printf('%.1f s', s.age_s) AS idle
FROM c JOIN s USING (rank)
-- once hung_rank names a culprit it says this
WHERE NOT EXISTS (SELECT 1 FROM ranks.hung WHERE culprit)""",
    message=(
        "rank {rank} stalls the job: {waited} {waited_s:.1f} s ({ratio:.0f}x the job's p99 step time of "
        "{p99_ms:.1f} ms) in {op} seq {seq} of process group {pg}, which rank {rank} has not issued; its last step "
        "was {idle} ago (step {step}) and it is now in {top_frame}."
    ),
    next=[
        "probe --rank {rank} backtrace",
        "probe --rank {rank} backtrace --native",
        "probe --ranks all backtrace --group",
    ],
)

rule(
    "straggler",
    family="distributed",
    severity="warning",
    scope="job",
    description=(
        "A rank's compute time per step (its step time without the flight recorder) exceeds the other ranks' by "
        "PROBE_STRAGGLER_FACTOR."
    ),
    sql="SELECT rank, step, ratio, basis, step_time * 1000 AS step_ms, top_frame FROM ranks.stragglers",
    message=(
        "rank {rank} is a straggler: {ratio:.1f}x the other ranks' time per step ({basis}; {step_ms:.1f} ms steps), "
        "now in {top_frame}."
    ),
    next=["probe --rank {rank} backtrace", "probe --ranks all status"],
)

rule(
    "desync",
    family="distributed",
    severity="warning",
    scope="job",
    description=(
        "A rank's step counter lags the most advanced rank by more than PROBE_DESYNC_STEPS, beyond what the ranks "
        "answering at slightly different moments explains (ranks.desync)."
    ),
    sql="SELECT rank, step, behind, step + behind AS lead_step FROM ranks.desync",
    message=(
        "rank {rank} is at step {step}, {behind} step(s) behind the most advanced rank (at step {lead_step}): ranks "
        "that synchronise every step stay within a step of each other."
    ),
    next=["probe --ranks all status", "probe --rank {rank} backtrace"],
)

rule(
    "rank_died",
    family="crash",
    severity="critical",
    description=(
        "A process (a rank of the job) is gone and its post-mortem record says how: an exception, a fatal signal, or "
        "a kill without warning; across ranks, which ranks wait for it and in which collective."
    ),
    sql=f"""
WITH waiters AS (SELECT string_agg(CAST(rank AS VARCHAR), ',' ORDER BY rank) AS ranks,
                        string_agg(DISTINCT pending_op, ', ') AS ops
                 FROM ranks.status WHERE state = 'waiting')
SELECT d.rank, d.pid, d.step, d.exit_cause, d.exit_reason, coalesce('rank ' || d.rank, 'pid ' || d.pid) AS who,
       CASE WHEN waiters.ranks IS NULL THEN ''
            ELSE '; ' || {ranks_phrase("waiters.ranks", " waits for it", " wait for it")}
                 || coalesce(' in ' || waiters.ops, '') END AS waiting
FROM ranks.status AS d, waiters
WHERE d.state = 'dead'
  AND (d.exit_cause NOT IN ('exit', 'interrupted', 'terminated') OR waiters.ranks IS NOT NULL
       -- a deliberate end still counts with a non-zero sys.exit code or a worker thread's death
       OR (d.exit_cause = 'exit' AND d.exit_reason LIKE 'exited with code %')
       OR d.exit_reason LIKE '%thread % died of %')""",
    message="{who} died at step {step} ({exit_cause}): {exit_reason}{waiting}.",
    next=[
        "probe {target} backtrace",
        "probe list --dead",
        'probe {target} query "SELECT step, loss, duration FROM torch.steps ORDER BY step DESC LIMIT 20"',
    ],
)

rule(
    "ranks_same_data",
    family="distributed",
    severity="warning",
    scope="job",
    description=(
        "Every rank of a DistributedDataParallel job (torch.ddp on each) computed a bit-identical loss at each of "
        "the last 20 or more steps they all have (of the last 100): the replicas hold the same weights, so identical "
        "losses mean identical batches; the job trains N copies of one shard (a DataLoader without a "
        "DistributedSampler, or the same seed and shuffling on every rank)."
    ),
    sql="""
WITH dp AS (SELECT count(DISTINCT rank) AS n FROM torch.ddp),
job AS (SELECT count(DISTINCT rank) AS n FROM torch.steps),
last AS (SELECT min(top) AS hi FROM (SELECT rank, max(step) AS top FROM torch.steps GROUP BY rank)),
per_step AS (
  SELECT step, count(*) AS n, count(DISTINCT loss) AS losses, arg_min(loss, rank) AS loss
  FROM torch.steps, last WHERE isfinite(loss) AND step BETWEEN last.hi - 99 AND last.hi GROUP BY step)
SELECT job.n AS ranks, count(*) AS steps, min(p.step) AS first, max(p.step) AS step, arg_max(p.loss, p.step) AS loss
FROM per_step AS p, job, dp
WHERE p.n = job.n AND job.n >= 2 AND dp.n = job.n
GROUP BY job.n
HAVING count(*) >= 20 AND bool_and(p.losses = 1)""",
    message=(
        "the {ranks} DDP ranks computed bit-identical losses at every one of steps {first}-{step} ({steps} steps "
        "they all have; the last {loss:.6g}): the replicas hold the same weights, so they are fed the same batches "
        "and the job trains {ranks} copies of one shard. Give each rank its own part of the data "
        "(DataLoader(..., sampler=DistributedSampler(dataset)) and sampler.set_epoch(epoch) every epoch, or a "
        "seed that includes the rank)."
    ),
    next=[
        (
            'probe --ranks all query "SELECT step, rank, loss FROM torch.steps WHERE step > {step} - 5 ORDER BY '
            'step, rank"'
        ),
        'probe --ranks all query "SELECT rank, name, loader_type, dataset_type, batch_size FROM torch.dataloaders"',
    ],
)

rule(
    "loss_dispersion",
    family="distributed",
    severity="warning",
    scope="job",
    description=(
        "Over the last 50 steps all ranks have, one rank's mean loss is far from the ranks' median (by 25% and 0.05, "
        "and by 4 standard errors; of two ranks, the higher): ranks training one model should see about the same "
        "loss."
    ),
    sql="""
WITH last AS (SELECT min(top) AS hi FROM (SELECT rank, max(step) AS top FROM torch.steps GROUP BY rank)),
per AS (
  SELECT rank, max(step) AS step, min(step) AS first, avg(loss) AS mean, stddev_samp(loss) AS sd, count(*) AS n
  FROM torch.steps, last WHERE isfinite(loss) AND step BETWEEN last.hi - 49 AND last.hi
  GROUP BY rank HAVING count(*) >= 20),
cmp AS (
  SELECT *, count(*) OVER () AS ranks, median(mean) OVER () AS med, min(mean) OVER () AS low,
         median(sd) OVER () AS med_sd
  FROM per)
SELECT rank, step, first, ranks, mean, CASE WHEN ranks = 2 THEN low ELSE med END AS others,
       mean / nullif(CASE WHEN ranks = 2 THEN low ELSE med END, 0) AS ratio,
       CASE WHEN ranks = 2 THEN 'the other rank''s' ELSE 'the median of the ' || ranks || ' ranks,' END AS against
FROM cmp
WHERE ranks >= 2
  AND abs(mean - CASE WHEN ranks = 2 THEN low ELSE med END) > 0.25 * abs(med) + 0.05
  AND abs(mean - CASE WHEN ranks = 2 THEN low ELSE med END) > 4 * greatest(sd, med_sd) / sqrt(n)""",
    message=(
        "rank {rank}'s loss averages {mean:.4g} over steps {first}-{step}, {ratio:.3g}x {against} {others:.4g}: "
        "ranks that train one model should see about the same loss, so this rank's data differs (a corrupt or "
        "mislabeled shard, other preprocessing) or its inputs are broken."
    ),
    next=[
        (
            'probe --ranks all query "SELECT rank, avg(loss) AS mean_loss, count(*) AS steps FROM torch.steps WHERE '
            'step > {step} - 50 GROUP BY rank ORDER BY rank"'
        ),
        'probe --rank {rank} query "SELECT step, loss, samples FROM torch.steps ORDER BY step DESC LIMIT 20"',
    ],
)
