"""The doctor's rules across the ranks of a job and about ranks that died: the hang's culprit, the
straggler, desync, loss dispersion, a rank's death, and data-parallel ranks that should do the same thing and
do not: a rank's DDP set up so that its replicas cannot agree or pay for nothing (``torch.ddp``), and ranks
stuck in different collectives at the same place of the sequence (the flight recorder), as when one rank ran
out of batches. docs/doctor.md lists them.
"""

from __future__ import annotations

from probe.sql.ranks import STALL_MIN_S, STALL_PACE, ranks_phrase

from probe.diagnosis.rules import rule

# the ranks found odd, as a list: in collectives_out_of_step and in collective_mismatch
_ODD_NOW = "string_agg(CAST(now.rank AS VARCHAR), ',' ORDER BY now.rank) FILTER (WHERE now.issued <> now.usual)"
_ODD_PICKED = "string_agg(DISTINCT CAST(p.rank AS VARCHAR), ',' ORDER BY CAST(p.rank AS VARCHAR)) FILTER (WHERE p.odd)"


# the last steps that every rank measured (few: each rank picks its own), each with one input fingerprint on all
_SAME_INPUTS = 3

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
        "Every rank of a DistributedDataParallel job (torch.ddp on each) was fed the same data, from either of two "
        f"signs: at each of the last {_SAME_INPUTS} steps that every rank measured, the primary model's input had one "
        "fingerprint on every rank (torch.batches; batches that change from step to step, a constant input is "
        "same_batch's), or, over the last 100 steps they all have, the ranks computed a bit-identical loss at each "
        "of 20 or more (the replicas hold the same weights, so identical losses mean identical batches). The "
        "fingerprints name it when the losses differ (dropout or augmentation seeded per rank). The job trains N "
        "copies of one shard (a DataLoader without a DistributedSampler, or the same seed and shuffling on every "
        "rank)."
    ),
    sql=f"""
WITH dp AS (SELECT count(DISTINCT rank) AS n FROM torch.ddp),
job AS (SELECT count(DISTINCT rank) AS n FROM torch.steps),
last AS (SELECT min(top) AS hi FROM (SELECT rank, max(step) AS top FROM torch.steps GROUP BY rank)),
by_input AS (
  SELECT step, count(DISTINCT rank) AS n, count(DISTINCT input_hash) AS kinds, min(input_hash) AS value,
         row_number() OVER (ORDER BY step DESC) AS age
  FROM torch.batches WHERE input_hash IS NOT NULL GROUP BY step HAVING count(DISTINCT rank) = (SELECT n FROM job)),
by_loss AS (
  SELECT step, count(*) AS n, count(DISTINCT loss) AS kinds, arg_min(loss, rank) AS loss
  FROM torch.steps, last WHERE isfinite(loss) AND step BETWEEN last.hi - 99 AND last.hi GROUP BY step),
inputs AS (  -- batches that change from step to step (one input throughout is same_batch's)
  SELECT count(*) AS steps, min(step) AS first, max(step) AS step,
         printf('were fed the same input on every rank (one fingerprint in torch.batches; %d batches in all) at '
                'each of the last %d steps that they all measured (%s)', count(DISTINCT value), count(*),
                string_agg(CAST(step AS VARCHAR), ', ' ORDER BY step)) AS what
  FROM by_input WHERE age <= {_SAME_INPUTS}
  HAVING count(*) = {_SAME_INPUTS} AND bool_and(kinds = 1) AND count(DISTINCT value) >= 2),
losses AS (
  SELECT count(*) AS steps, min(p.step) AS first, max(p.step) AS step,
         printf('computed bit-identical losses at every one of steps %d-%d (%d steps they all have; the last %s): '
                'the replicas hold the same weights, so they are fed the same batches', min(p.step), max(p.step),
                count(*), printf('%.6g', arg_max(p.loss, p.step))) AS what
  FROM by_loss AS p, job WHERE p.n = job.n
  HAVING count(*) >= 20 AND bool_and(p.kinds = 1)),
found AS (SELECT 'inputs' AS basis, * FROM inputs
          UNION ALL SELECT 'losses', * FROM losses WHERE NOT EXISTS (SELECT 1 FROM inputs))
SELECT job.n AS ranks, found.*
FROM found, job, dp
WHERE job.n >= 2 AND dp.n = job.n""",
    message=(
        "the {ranks} DDP ranks {what}: the job trains {ranks} copies of one shard. Give each rank its own part of "
        "the data (DataLoader(..., sampler=DistributedSampler(dataset)) and sampler.set_epoch(epoch) every epoch, "
        "or a seed that includes the rank)."
    ),
    next=[
        (
            'probe --ranks all query "SELECT step, rank, loss FROM torch.steps WHERE step > {step} - 5 ORDER BY '
            'step, rank"'
        ),
        (
            'probe --ranks all query "SELECT step, rank, input_hash FROM torch.batches WHERE step > {step} - 20 '
            'ORDER BY step, rank"'
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

rule(
    "collectives_out_of_step",
    family="distributed",
    severity="critical",
    scope="job",
    explains=["weights_diverged"],  # the mispaired all-reduces average other steps' gradients: the replicas drift
    description=(
        "The ranks of a DDP model's process group had issued different numbers of collectives by the same step "
        "(torch.weight_sums.collectives, read at the checksum steps): some ranks ran a collective the others did "
        "not, so every later collective pairs with a different one on the other ranks (NCCL usually hangs, gloo "
        "can go on with wrong sums); names the odd ranks and the steps between which it happened."
    ),
    sql=f"""
WITH c AS (SELECT rank, step, model, CAST(any_value(collectives) AS BIGINT) AS issued FROM torch.weight_sums
           WHERE collectives IS NOT NULL GROUP BY rank, step, model),
n AS (SELECT model, count(DISTINCT rank) AS n FROM c GROUP BY model),
k AS (SELECT c.* FROM c JOIN (SELECT c.model, c.step FROM c JOIN n USING (model) GROUP BY c.model, c.step, n.n
                              HAVING count(DISTINCT c.rank) = n.n AND n.n >= 2) AS common USING (model, step)),
per AS (SELECT model, step, min(issued) <> max(issued) AS differs, mode(issued) AS usual FROM k GROUP BY model, step),
last AS (SELECT model, max(step) AS step FROM per GROUP BY model),
agreed AS (SELECT model, max(step) AS step FROM per WHERE NOT differs GROUP BY model),
since AS (SELECT p.model, min(p.step) AS step FROM per AS p LEFT JOIN agreed AS a USING (model)
          WHERE p.differs AND p.step > coalesce(a.step, -1) GROUP BY p.model),
now AS (SELECT k.model, k.step, k.rank, k.issued, p.usual, n.n,
               count(*) FILTER (WHERE k.issued = p.usual) OVER (PARTITION BY k.model) AS usual_ranks
        FROM k JOIN last USING (model, step) JOIN per AS p USING (model, step) JOIN n USING (model)
        WHERE p.differs)
SELECT now.model, any_value(now.step) AS step, any_value(s.step) AS since, any_value(a.step) AS agreed_step,
       CASE WHEN any_value(now.usual_ranks) > any_value(now.n) / 2.0
            THEN {ranks_phrase(_ODD_NOW, " differs from the others", " differ from the others")}
            ELSE 'the ranks disagree' END AS who,
       string_agg('rank ' || now.rank || ' ' || now.issued, ', ' ORDER BY now.rank) AS counts,
       coalesce(printf('they had issued as many at step %d and differ since step %d', any_value(a.step),
                       any_value(s.step)),
                printf('they differ at every step compared, from step %d on', any_value(s.step))) AS history
FROM now JOIN since AS s USING (model) LEFT JOIN agreed AS a USING (model)
GROUP BY now.model""",
    message=(
        "the ranks of {model}'s process group ran different collectives ({who}): by step {step} they had issued "
        "{counts} collectives; {history}. From then on every collective pairs with a different one on the other "
        "ranks: NCCL usually hangs, gloo can go on averaging the wrong tensors (the replicas drift apart). Look "
        "between those steps for a collective that not every rank runs: an all_reduce or barrier under "
        "`if rank == 0:`, or a branch only some ranks take."
    ),
    next=[
        (
            'probe --ranks all query "SELECT step, rank, any_value(collectives) AS collectives FROM torch.weight_sums '
            'GROUP BY ALL ORDER BY step DESC, rank LIMIT 24"'
        ),
        (
            'probe --ranks all query "SELECT rank, step, seq, op, input_dtypes, call_site FROM torch.collectives '
            'WHERE step <= {since} ORDER BY seq DESC, rank LIMIT 24"'
        ),
    ],
)

rule(
    "ddp_buffers_not_broadcast",
    family="distributed",
    severity="warning",
    description=(
        "A DistributedDataParallel model with plain BatchNorm modules runs with broadcast_buffers=False (torch.ddp): "
        "each rank keeps running statistics of its own shard, so evaluation and a checkpoint differ by the rank that "
        "made them."
    ),
    sql=f"""SELECT min(rank) AS rank, model, any_value(world_size) AS world_size,
        any_value(norm_modules) AS norm_modules,
                  coalesce({ranks_phrase("string_agg(CAST(rank AS VARCHAR), ',' ORDER BY rank)")}, 'this rank') AS ranks
           FROM torch.ddp WHERE NOT broadcast_buffers AND norm_modules IS NOT NULL AND world_size > 1 GROUP BY model""",
    message=(
        "DistributedDataParallel({model}) runs with broadcast_buffers=False and has BatchNorm modules "
        "({norm_modules}) on {ranks}: each of the {world_size} ranks keeps the running mean and variance of its own "
        "shard, so a checkpoint saved by rank 0 holds rank 0's statistics alone and ranks evaluate differently; use "
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping, or broadcast_buffers=True."
    ),
    next=['probe {target} query "SELECT model, broadcast_buffers, norm_modules FROM torch.ddp"'],
)

rule(
    "ddp_unused_search",
    family="slow",
    severity="info",
    description=(
        "A DistributedDataParallel model runs with find_unused_parameters=True, yet DDP's own samples (torch.ddp, "
        "10 iterations on) never found an unused parameter: it walks the autograd graph after every forward for "
        "nothing."
    ),
    sql="""SELECT min(rank) AS rank, model, min(iteration) AS iteration FROM torch.ddp
           WHERE find_unused_parameters AND NOT static_graph AND iteration >= 10 AND unused_seen = 0 GROUP BY model""",
    message=(
        "DistributedDataParallel({model}) runs with find_unused_parameters=True, but none of DDP's samples up to "
        "iteration {iteration} found an unused parameter: every step pays a walk of the autograd graph for nothing; "
        "pass find_unused_parameters=False (or static_graph=True when the graph never changes)."
    ),
    next=['probe {target} query "SELECT model, find_unused_parameters, iteration, unused_seen FROM torch.ddp"'],
)

# Ranks stuck for 50x the job's p99 step time (ranks.latest's p99: the slowest rank's over its last 200 steps), 5 s
# at least: every rank waits here, so no rank is stalled (ranks.status) and the pace is this rule's own to judge.
_PACE = 50
_PACE_MIN_S = 5
PACE_CTE = "pace AS (SELECT max(p99) AS p99 FROM ranks.latest)"

rule(
    "collective_mismatch",
    family="distributed",
    severity="critical",
    scope="job",
    explains=["hung"],  # every rank waits in it: no step completes on any of them
    description=(
        f"Every rank of a process group has waited {_PACE}x the job's p99 step time ({_PACE_MIN_S} s at least) at "
        "the same sequence number in different collectives (torch.process_groups, the flight recorder): the job "
        "hangs because one rank left the others' code path (uneven inputs: its data ran out first); names the rank "
        "that issued fewest collectives, else the one whose collective differs from most."
    ),
    sql=f"""
WITH {PACE_CTE},
g AS (SELECT rank, pg, pending_seq AS seq, pending_op AS op, pending_s, coalesce(pending_site, '?') AS site,
             coalesce(last_enqueued, -1) AS issued
      FROM torch.process_groups WHERE pending > 0),
members AS (SELECT pg, count(DISTINCT rank) AS n FROM torch.process_groups GROUP BY pg),
stuck AS (SELECT g.pg, g.seq FROM g JOIN members USING (pg), pace
          GROUP BY g.pg, g.seq, members.n, pace.p99
          HAVING count(DISTINCT g.rank) = members.n AND members.n >= 2 AND count(DISTINCT g.op) > 1
             AND min(g.pending_s) > greatest({_PACE} * pace.p99, {_PACE_MIN_S})),
w AS (SELECT g.*, count(*) OVER (PARTITION BY g.pg, g.seq, g.op) AS same,
             min(g.issued) OVER (PARTITION BY g.pg, g.seq) AS fewest, max(g.issued)
                 OVER (PARTITION BY g.pg, g.seq) AS most
      FROM g JOIN stuck USING (pg, seq)),
pick AS (SELECT *, CASE WHEN fewest < most THEN issued = fewest
                        ELSE same = (SELECT min(x.same) FROM w AS x WHERE x.pg = w.pg AND x.seq = w.seq) END AS odd
         FROM w)
SELECT min(p.rank) FILTER (WHERE p.odd) AS rank, any_value(l.step) FILTER (WHERE p.odd) AS step, p.pg, p.seq,
       min(p.pending_s) AS waited_s, pace.p99 * 1000 AS p99_ms,
       {ranks_phrase(_ODD_PICKED)} AS culprits,
       string_agg(p.op || ' at ' || p.site, '; ' ORDER BY p.rank) FILTER (WHERE p.odd) AS culprit_op,
       string_agg('rank ' || p.rank || ' issued ' || p.op || ' at ' || p.site, '; ' ORDER BY p.rank)
           FILTER (WHERE NOT p.odd) AS others
FROM pick AS p CROSS JOIN pace LEFT JOIN ranks.latest AS l ON l.rank = p.rank
GROUP BY p.pg, p.seq, pace.p99
HAVING count(*) FILTER (WHERE NOT p.odd) > 0""",
    message=(
        "{culprits} left the other ranks' path: at seq {seq} of process group {pg} it issued {culprit_op}, "
        "where {others}, and every rank has waited {waited_s:.1f} s since ({p99_ms:.1f} ms is the job's p99 step "
        "time): the job hangs. A rank whose data ran out first (its shard had fewer batches: uneven inputs) leaves "
        "the loop while the others wait in DDP's collectives of one more step; give every rank the same number of "
        "batches (DistributedSampler pads, or drop_last=True) or train inside model.join(). Its last step was {step}."
    ),
    next=[
        "probe --ranks all backtrace --group",
        (
            'probe --ranks all query "SELECT rank, seq, op, input_sizes, step FROM torch.collectives ORDER BY '
            'record_id DESC LIMIT 10"'
        ),
    ],
)
