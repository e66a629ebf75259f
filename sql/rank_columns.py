"""The ``ranks.*`` views' columns (``sql.ranks`` holds their SQL): name, type and description of each, in the
order the views return them; the planner types the views' answers with them and the docs describe them.
"""

from __future__ import annotations

from .ranks import STALL_MIN_S, STALL_PACE


VIEW_COLUMNS = {
    "ranks.latest": [
        ("rank", "INTEGER", "Rank that answered."),
        ("pid", "BIGINT", "Process id of the rank."),
        ("host", "VARCHAR", "Host name of the rank."),
        ("step", "BIGINT", "Last step in torch.steps."),
        ("last_step_at", "TIMESTAMP", "When that step ended."),
        ("age_s", "DOUBLE", "Seconds since the last step ended, on the rank's own clock."),
        ("step_time", "DOUBLE", "Median duration of the last 20 steps in seconds."),
        ("steps_seen", "BIGINT", "Rows in the rank's torch.steps ring."),
        (
            "state",
            "VARCHAR",
            "training, idle, hung or dead (from process.info; dead: read from its post-mortem record); stopped or "
            "unreachable for a rank that did not answer.",
        ),
        ("hung_since", "TIMESTAMP", "When the hang watchdog saw the last step, if it fired."),
        ("top_frame", "VARCHAR", "Innermost frame of the main thread: func (file:line)."),
        (
            "in_collective",
            "BOOLEAN",
            "Whether the rank has an unfinished collective (flight recorder), else whether its main thread is inside "
            "torch.distributed.",
        ),
        ("recorder", "BOOLEAN", "Whether torch's flight recorder reports process groups on the rank."),
        ("compute", "DOUBLE", "Median torch.steps.compute of the last 20 steps with recorded collectives."),
        ("comm_wait", "DOUBLE", "Median torch.steps.comm_wait of the same steps."),
        ("wait_share", "DOUBLE", "Share of those steps' time spent waiting for the other ranks."),
        ("pending_pg", "VARCHAR", "Process group of the oldest unfinished collective."),
        ("pending_seq", "BIGINT", "Its sequence id."),
        ("pending_op", "VARCHAR", "Its operation."),
        ("pending_sizes", "VARCHAR", "Its input shapes."),
        ("pending_s", "DOUBLE", "Seconds it has been unfinished."),
        ("source", "VARCHAR", "live, or postmortem for a dead rank answered by its post-mortem record."),
        ("exit_cause", "VARCHAR", "How a dead rank ended (exception, fatal_signal, killed ...); NULL while it runs."),
        ("exit_reason", "VARCHAR", "How it ended, in words (the exception and where it was raised)."),
        ("p99", "DOUBLE", "p99 step time of its last 200 steps in seconds; NULL before 20 steps."),
        ("main_state", "VARCHAR", "OS scheduler state of its main thread (process.info.main_state)."),
    ],
    "ranks.issued": [
        ("rank", "INTEGER", "Rank that issued the collective."),
        ("pg", "VARCHAR", "Process group."),
        ("seq", "BIGINT", "Collective sequence id."),
        ("op", "VARCHAR", "Operation."),
        ("input_sizes", "VARCHAR", "Input shapes."),
        ("input_dtypes", "VARCHAR", "Input element types."),
        ("created_at", "TIMESTAMP", "When the rank issued it."),
        ("step", "BIGINT", "The rank's step in progress when it issued it."),
    ],
    "ranks.collectives": [
        ("rank", "INTEGER", "Rank."),
        ("pg", "VARCHAR", "Process group (NULL on the row of a rank that did not answer)."),
        ("pg_desc", "VARCHAR", "Process group description."),
        ("last_enqueued", "BIGINT", "Sequence id of the last collective the rank issued in the group."),
        ("last_completed", "BIGINT", "Sequence id of the last one that finished there."),
        (
            "behind",
            "BIGINT",
            "How many collectives the rank has issued fewer than the most advanced rank of the group.",
        ),
        ("pending", "INTEGER", "Its unfinished collectives."),
        ("pending_seq", "BIGINT", "Sequence id of the oldest unfinished one: where the rank waits."),
        ("pending_op", "VARCHAR", "Its operation."),
        ("pending_sizes", "VARCHAR", "Its input shapes."),
        ("pending_s", "DOUBLE", "Seconds it has been unfinished."),
        ("pending_site", "VARCHAR", "Where it was issued."),
        (
            "role",
            "VARCHAR",
            "waiting (unfinished for PROBE_HUNG_AFTER s), culprit (a waiting rank's seq is beyond its last issued one, "
            "or it is silent while others wait or make no step), silent, or ok.",
        ),
        (
            "waits_for",
            "VARCHAR",
            "For a waiting rank: the ranks that have not issued its collective (and silent ranks).",
        ),
        (
            "waited_by",
            "VARCHAR",
            "For a culprit: the ranks waiting for it (for a silent one: the ranks without a step for PROBE_HUNG_AFTER "
            "s).",
        ),
        (
            "mismatch",
            "VARCHAR",
            "The first recent seq where this rank issued another op, shape or dtype than the other ranks.",
        ),
    ],
    "ranks.status": [
        ("rank", "INTEGER", "Rank."),
        ("host", "VARCHAR", "Host."),
        ("pid", "BIGINT", "Process id."),
        ("step", "BIGINT", "Last step."),
        ("age_s", "DOUBLE", "Seconds since its last step, on its own clock."),
        ("step_time", "DOUBLE", "Median step time of the last 20 steps."),
        ("compute", "DOUBLE", "Compute time per step: median step time minus comm_wait."),
        (
            "comm_wait",
            "DOUBLE",
            "Median time per step waiting for the other ranks: per step, the longest gap between this rank issuing a "
            "collective and the last rank issuing the same (pg, seq) (basis collectives).",
        ),
        ("wait_share", "DOUBLE", "Share of step time spent waiting for the other ranks."),
        (
            "state",
            "VARCHAR",
            "training, slow, waiting, stalled, hung, idle, unreachable, or dead (gone; its post-mortem record "
            "answers) (see docs/ranks.md).",
        ),
        ("culprit", "BOOLEAN", "Whether this is the rank the others wait for."),
        ("reason", "VARCHAR", "Why, in words: what it waits in and for whom, who waits for it, how much slower it is."),
        ("mismatch", "VARCHAR", "A collective mismatch involving this rank, if one is in the recent collectives."),
        ("in_collective", "BOOLEAN", "Whether it has an unfinished collective."),
        ("pending_op", "VARCHAR", "The op it waits in."),
        ("pending_seq", "BIGINT", "That op's sequence id."),
        ("work", "DOUBLE", "The time compared for slow: compute, or step_time without recorder timings."),
        ("others", "DOUBLE", "The other ranks' median of the same."),
        (
            "basis",
            "VARCHAR",
            "How compute was found: collectives (lined up across ranks), steps (this rank's torch.steps split) or "
            "step_time (no recorder).",
        ),
        ("top_frame", "VARCHAR", "Innermost frame of its main thread."),
        (
            "exit_cause",
            "VARCHAR",
            "For a dead rank: how it ended (exception, thread_exception, fatal_signal, killed, exit ...).",
        ),
        ("exit_reason", "VARCHAR", "For a dead rank: how it ended, in words (its post-mortem record's summary)."),
        ("pace", "DOUBLE", "The job's p99 step time: the slowest answering rank's p99 over its last 200 steps."),
        (
            "stall_after",
            "DOUBLE",
            f"Seconds without a step after which a rank is stalled (or waiting): {STALL_PACE}x pace, "
            f"{STALL_MIN_S} s at least.",
        ),
    ],
    "ranks.stragglers": [
        ("rank", "INTEGER", "Rank that is slower than the others."),
        ("step", "BIGINT", "Its last step."),
        ("step_time", "DOUBLE", "Its median step time in seconds."),
        ("compute", "DOUBLE", "Its median compute time per step."),
        ("comm_wait", "DOUBLE", "Its median wait for the other ranks per step."),
        ("others_compute", "DOUBLE", "Median of the other ranks' compute (step_time without recorder timings)."),
        ("ratio", "DOUBLE", "Its compute over the others'; above PROBE_STRAGGLER_FACTOR."),
        ("basis", "VARCHAR", "collectives, steps or step_time: see ranks.status."),
        ("top_frame", "VARCHAR", "Innermost frame of its main thread."),
    ],
    "ranks.desync": [
        ("rank", "INTEGER", "Rank whose step counter lags."),
        ("step", "BIGINT", "Its last step."),
        (
            "behind",
            "BIGINT",
            "Steps behind the most advanced rank; above PROBE_DESYNC_STEPS, and more than the steps the leader made "
            "after this rank's last step (a rank that answered earlier is not behind).",
        ),
    ],
    "ranks.hung": [
        (
            "rank",
            "INTEGER",
            "Rank that is hung (no step for PROBE_HUNG_AFTER s), waiting in a collective (no step for that or for "
            "the job's pace), or silent while others wait.",
        ),
        ("step", "BIGINT", "Its last step."),
        ("age_s", "DOUBLE", "Seconds since its last step."),
        (
            "state",
            "VARCHAR",
            "hung (the culprit), waiting (inside a collective), or unreachable or dead (a culprit the others wait "
            "for): ranks.status's state.",
        ),
        ("culprit", "BOOLEAN", "Whether the others wait for it; culprits come first."),
        ("in_collective", "BOOLEAN", "Whether it has an unfinished collective (flight recorder)."),
        ("pending_op", "VARCHAR", "The op it waits in."),
        ("pending_seq", "BIGINT", "That op's sequence id."),
        ("reason", "VARCHAR", "Why, in words."),
        ("top_frame", "VARCHAR", "Innermost frame of its main thread."),
    ],
    "ranks.errors": [
        ("rank", "INTEGER", "Rank that did not answer."),
        ("host", "VARCHAR", "Its host, from the registry."),
        ("error", "VARCHAR", "Why: unreachable, timed out, or the query failed there."),
    ],
}
