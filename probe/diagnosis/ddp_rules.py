"""The doctor's rules about data-parallel ranks that should do the same thing and do not: ranks whose weights
differ at the same step (``torch.weight_sums``, compared across ranks in the client: probe issues no
collective), a rank's DDP set up so that its replicas cannot agree or pay for nothing (``torch.ddp``), and
ranks stuck in different collectives at the same place of the sequence (the flight recorder), as when one
rank ran out of batches. docs/doctor.md lists them.
"""

from __future__ import annotations

from probe.sql.ranks import ranks_phrase

from .rules import rule

# the ranks found odd, as a list: in collectives_out_of_step and in collective_mismatch
_ODD_NOW = "string_agg(CAST(now.rank AS VARCHAR), ',' ORDER BY now.rank) FILTER (WHERE now.issued <> now.usual)"
_ODD_PICKED = "string_agg(DISTINCT CAST(p.rank AS VARCHAR), ',' ORDER BY CAST(p.rank AS VARCHAR)) FILTER (WHERE p.odd)"

__all__: list = []

_TOLERANCE = 1e-7  # relative: float64 sums of the same float32 values agree to ~1e-16; one unsynced step moves ~1e-4
_NAMES_SHOWN = 5

rule(
    "weights_diverged",
    family="distributed",
    severity="warning",
    scope="job",
    description=(
        "The DDP replicas hold different weights: at the last step every rank took a checksum of "
        "(torch.weight_sums), some parameter tensors' checksums differ across ranks; names the first tensors that "
        "differ, by module, and since which step."
    ),
    sql=f"""
WITH s AS (SELECT rank, step, model, position, name, numel, checksum FROM torch.weight_sums),
ranks_n AS (SELECT model, count(DISTINCT rank) AS n FROM s GROUP BY model),
common AS (SELECT s.model, s.step FROM s JOIN ranks_n USING (model) GROUP BY s.model, s.step, ranks_n.n
           HAVING count(DISTINCT s.rank) = ranks_n.n AND ranks_n.n >= 2),
cmp AS (SELECT s.model, s.step, s.position, any_value(s.name) AS name,
               max(s.checksum) - min(s.checksum) > {_TOLERANCE} * greatest(max(abs(s.checksum)), 1e-30) AS differs
        FROM s JOIN common USING (model, step) GROUP BY s.model, s.step, s.position),
last AS (SELECT model, max(step) AS step FROM common GROUP BY model),
agreed AS (SELECT model, max(step) AS step FROM (SELECT model, step FROM cmp GROUP BY model, step
    HAVING NOT bool_or(differs))
           GROUP BY model),
bad AS (SELECT c.* FROM cmp AS c JOIN last USING (model, step) WHERE c.differs),
-- the module of each differing tensor (its name less the last part), in the model's order
mods AS (SELECT model, CASE WHEN contains(name, '.') THEN regexp_replace(name, '\\.[^.]*$', '') ELSE name END AS module,
                min(position) AS first, count(*) AS tensors, any_value(name) AS one FROM bad GROUP BY ALL),
odd AS (  -- with three ranks or more, the ranks whose checksum is not the most common one
  SELECT s.model, string_agg(DISTINCT CAST(s.rank AS VARCHAR), ',' ORDER BY CAST(s.rank AS VARCHAR)) AS ranks
  FROM s JOIN bad USING (model, step, position)
  JOIN (SELECT s2.model, s2.position, mode(s2.checksum) AS usual, count(*) - max(cnt) AS off
        FROM s AS s2 JOIN bad USING (model, step, position)
        JOIN (SELECT model, step, position, checksum, count(*) AS cnt FROM s GROUP BY ALL) AS k
          ON k.model = s2.model AND k.step = s2.step AND k.position = s2.position AND k.checksum = s2.checksum
        GROUP BY s2.model, s2.position) AS u ON u.model = s.model AND u.position = s.position
  WHERE s.checksum <> u.usual AND u.off < (SELECT n FROM ranks_n WHERE ranks_n.model = s.model) / 2.0
  GROUP BY s.model),
found AS (
SELECT b.model, min(l.step) AS step, count(*) AS differ,
       (SELECT count(DISTINCT position) FROM s WHERE s.model = b.model AND s.step = min(l.step)) AS tensors,
       arg_min(b.name, b.position) AS first_tensor,
       coalesce((SELECT min(c.step) FROM cmp AS c WHERE c.model = b.model AND c.differs
                   AND c.step > coalesce((SELECT a.step FROM agreed AS a
                       WHERE a.model = b.model), -1)), min(l.step)) AS since,
       coalesce(printf('step %d', (SELECT a.step FROM agreed AS a
           WHERE a.model = b.model)), 'no step compared') AS agreed_at,
       (SELECT a.step FROM agreed AS a WHERE a.model = b.model) AS agreed_step,
       (SELECT array_to_string(list_slice(list(CASE WHEN m.tensors = 1 THEN m.one ELSE m.module || '.* ('
           || m.tensors || ' tensors)' END
                                               ORDER BY m.first), 1, {_NAMES_SHOWN}), ', ')
               || CASE WHEN count(*) > {_NAMES_SHOWN} THEN ' and ' || (count(*) - {_NAMES_SHOWN})
                   || ' more modules' ELSE '' END
          FROM mods AS m WHERE m.model = b.model) AS modules,
       (SELECT n FROM ranks_n WHERE ranks_n.model = b.model) AS ranks,
       coalesce({
        ranks_phrase(
            "(SELECT o.ranks FROM odd AS o WHERE o.model = b.model)",
            " differs from the others",
            " differ from the others",
        )
    },
                'the ranks disagree') AS who
FROM bad AS b JOIN last AS l USING (model)
GROUP BY b.model)
SELECT * EXCLUDE (agreed_step),
       coalesce(printf('they agreed last at step %d and differ since step %d', agreed_step, since),
                printf('they differ at every step compared, from step %d on', since)) AS history
FROM found""",
    message=(
        "the DDP replicas of {model} hold different weights: at step {step}, {differ} of {tensors} parameter tensors "
        "differ across the {ranks} ranks ({who}), first {modules}; {history}. DDP keeps every rank's weights "
        "identical only when every step's gradients are averaged: a forward through model.module (not the DDP "
        "wrapper) averages nothing, a parameter changed or a checkpoint loaded on one rank after wrapping is never "
        "sent to the others, and a collective issued on some ranks only pairs each later all-reduce with another "
        "step's gradients (gloo need not hang on it)."
    ),
    next=[
        (
            'probe --ranks all query "SELECT step, rank, name, checksum FROM torch.weight_sums WHERE step = {step} '
            'ORDER BY position, rank"'
        ),
        "probe --ranks all backtrace --group",
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
