"""The doctor's rules over what a measured step's data, update and loss scaling were (``torch.batches``,
``torch.updates``, ``torch.scaler``, recorded by ``probe.training.signals``): the same batch every step, batches of
one class, updates far too small or too large for the weights, and gradients clipped before GradScaler unscaled
them (docs/doctor.md lists them).

Each rule asks for a run of measured steps in a row (the rank's latest) and says since which step the run goes
(``since``), so a finding is about what the job does now.
"""

from __future__ import annotations

from probe.diagnosis.rules import rule


_BATCHES = 10  # measured steps in a row with one batch fingerprint, or single-class batches
_SPAN = 10  # steps those measured steps must span at least
_REPEATS = 3  # distinct batches seen again that show an epoch's order repeating (one batch again and again: same_batch)
_UPDATES = 5  # measured updates in a row whose size is judged
_SMALL = 1e-4  # an update below this fraction of the weights hardly moves them (~1e-3 is healthy)
_LARGE = 0.1  # one above it rewrites a tenth of them in one step
# an update below this fraction of the gradient before clipping (both against the weights): the step applies far
# less than the loss asks for (a converged model's gradients are small too, but its step applies them in full)
_EFFECTIVE = 0.01
_UPDATES_NEXT = (
    'probe {target} query "SELECT step, parameter, ratio, lr FROM torch.updates ORDER BY step DESC, ratio LIMIT 10"'
)
_SCALES = 5  # measured steps over which a loss scale keeps falling
_AFTER = 50  # steps before updates are judged (a warm-up's first rates, a zero-initialised layer's first steps)
# weights that grew this many times over within _GROWN_IN steps, by more than _RATE a step on average: updates of
# 1e-2 of the weights a step (the top of the healthy range) grow them by 1% a step at most, even when every step
# pushes the same way; an update far too large grows them many times over within a few steps, then stays hidden (its
# ratio falls as the weights it grew get large, or as the units it pushed past zero stop passing gradients)
_GROWTH = 4
_RATE = 0.02
_GROWN_IN = 300


def _current(alias: str) -> str:
    """SQL: ``alias.step`` (a run's last step) is at or after the rank's third last measured step: what the
    signal says is still so (a table whose rows stopped, as when the scaler or the model it was about is gone,
    leaves its last rows behind: they are no finding)."""
    return f"""{alias}.step >= (SELECT min(m.step) FROM (SELECT step FROM torch.steps AS k
                                    WHERE k.measured AND k.rank IS NOT DISTINCT FROM {alias}.rank
                                    ORDER BY step DESC LIMIT 3) AS m)"""


rule(
    "same_batch",
    family="input",
    severity="warning",
    description=(
        f"The primary model's input (and the loss's targets) had one fingerprint (torch.batches) at each of the last "
        f"{_BATCHES} or more measured steps, over {_SPAN} steps at least: the loop feeds the same batch again and "
        "again (next(iter(loader)) in the loop, a fixed slice of the data, a batch variable never reassigned)."
    ),
    sql=f"""
WITH b AS (
  SELECT rank, step, coalesce(input_hash, '') || '/' || coalesce(target_hash, '') AS key,
         row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
  FROM torch.batches WHERE input_hash IS NOT NULL OR target_hash IS NOT NULL),
r AS (SELECT rank, max(step) AS step, min(key) AS key FROM b WHERE age <= {_BATCHES} GROUP BY rank
      HAVING count(*) = {_BATCHES} AND count(DISTINCT key) = 1),
o AS (  -- the last measured step fed another batch
  SELECT b.rank, max(b.step) AS other FROM b JOIN r ON r.rank IS NOT DISTINCT FROM b.rank WHERE b.key <> r.key
  GROUP BY b.rank)
SELECT r.rank, r.step, min(b.step) AS since, count(*) AS steps, split_part(r.key, '/', 1) AS fingerprint
FROM r JOIN b ON b.rank IS NOT DISTINCT FROM r.rank AND b.key = r.key
LEFT JOIN o ON o.rank IS NOT DISTINCT FROM r.rank
WHERE b.step > coalesce(o.other, -1)
GROUP BY r.rank, r.step, r.key
HAVING r.step - min(b.step) >= {_SPAN} AND {_current("r")}""",
    message=(
        "the model was fed the same batch at every one of the last {steps} measured steps (since step {since}, up to "
        "step {step}; input fingerprint {fingerprint}): it sees one batch again and again and can only memorize it. "
        "Draw a new batch every step (iterate the DataLoader; next(iter(loader)) inside the loop restarts it at its "
        "first batch without shuffle), unless the whole dataset is one batch (full-batch training)."
    ),
    next=[
        'probe {target} query "SELECT step, input_hash, target_hash FROM torch.batches ORDER BY step DESC LIMIT 10"',
        'probe {target} query "SELECT name, dataset_type, batch_size FROM torch.dataloaders"',
    ],
)

rule(
    "sampler_epoch_unset",
    family="input",
    severity="warning",
    description=(
        "A DataLoader's DistributedSampler shuffles, yet its epoch (torch.dataloaders.sampler_epoch) is still 0 while "
        f"at least {_REPEATS} batches came back with the fingerprints they had before (torch.batches: the same samples "
        "again, at measured steps apart): set_epoch is never called, so every epoch repeats the first one's order."
    ),
    sql=f"""
WITH d AS (SELECT rank, name FROM torch.dataloaders
           WHERE sampler = 'DistributedSampler' AND shuffle AND sampler_epoch = 0),
k AS (  -- a batch seen again at a later measured step (its samples, in its order, came back), and how far apart
  SELECT rank, input_hash, step, step - lag(step) OVER (PARTITION BY rank, input_hash ORDER BY step) AS gap
  FROM torch.batches WHERE input_hash IS NOT NULL),
r AS (SELECT rank, count(DISTINCT input_hash) AS repeated, min(gap) AS apart, max(step) AS step FROM k
      WHERE gap IS NOT NULL GROUP BY rank HAVING count(DISTINCT input_hash) >= {_REPEATS})
SELECT d.rank, r.step, d.name, r.repeated, r.apart FROM d JOIN r ON r.rank IS NOT DISTINCT FROM d.rank""",
    message=(
        "DataLoader {name} shuffles with a DistributedSampler whose epoch is still 0, and {repeated} batches came back "
        "exactly as before (the same samples, at the closest {apart} steps apart; up to step {step}): "
        "set_epoch(epoch) is never called, so every epoch visits the data in the first epoch's order. Call "
        "sampler.set_epoch(epoch) at the start of each epoch, before iterating the loader."
    ),
    next=[
        'probe {target} query "SELECT name, sampler, shuffle, sampler_epoch FROM torch.dataloaders"',
        'probe {target} query "SELECT input_hash, count(*) AS seen, min(step), max(step) FROM torch.batches GROUP BY '
        'ALL HAVING count(*) > 1"',
    ],
)

rule(
    "single_class_batches",
    family="input",
    severity="warning",
    description=(
        f"Each of the last {_BATCHES} or more measured steps' class-index targets (torch.batches: 8 or more counted) "
        "held a single label: the same one every time (constant or broken labels), or one class a batch that changes "
        "from batch to batch (data ordered by class and not shuffled)."
    ),
    sql=f"""
WITH b AS (
  SELECT rank, step, labels, top_label, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
  FROM torch.batches WHERE labels IS NOT NULL AND samples >= 8),
r AS (SELECT rank, max(step) AS step, count(DISTINCT top_label) AS classes, min(top_label) AS label
      FROM b WHERE age <= {_BATCHES} GROUP BY rank HAVING count(*) = {_BATCHES} AND max(labels) = 1),
o AS (SELECT rank, max(step) AS other FROM b WHERE labels > 1 GROUP BY rank)
SELECT r.rank, r.step, r.classes, r.label::BIGINT AS label, min(b.step) AS since, count(*) AS steps,
       CASE WHEN r.classes = 1
            THEN 'every target is class ' || r.label::BIGINT || ': the labels are constant (a label column read '
                 || 'wrong, labels overwritten or filled with one value), so the model learns to answer '
                 || r.label::BIGINT || ' whatever its input'
            ELSE 'each batch holds one class, ' || r.classes || ' different ones from batch to batch: the data is '
                 || 'ordered by class and not shuffled, so every step pulls the model toward one class and the loss '
                 || 'swings with each new one (DataLoader(..., shuffle=True), or a sampler that mixes the classes)'
       END AS what
FROM r JOIN b ON b.rank IS NOT DISTINCT FROM r.rank
LEFT JOIN o ON o.rank IS NOT DISTINCT FROM r.rank
WHERE b.step > coalesce(o.other, -1)
GROUP BY r.rank, r.step, r.classes, r.label
HAVING r.step - min(b.step) >= {_SPAN} AND {_current("r")}""",
    message=(
        "the targets of each of the last {steps} measured batches hold a single label (since step {since}): {what}."
    ),
    next=[
        (
            'probe {target} query "SELECT step, labels, top_label, top_share FROM torch.batches ORDER BY step DESC '
            'LIMIT 10"'
        ),
        'probe {target} query "SELECT name, dataset_type, batch_size FROM torch.dataloaders"',
    ],
)


def _update_size(cond: str, also: str = "TRUE", label: str = "printf('%.2g', ratio)") -> str:
    """SQL: per rank, over the last _UPDATES measured updates and those of the last 20 steps (after step _AFTER,
    spanning 20 steps), the weight
    tensors whose median update/weight ratio meets ``cond`` (on ``ratio``, ``grad_ratio`` and ``growth``: how many
    times over the tensor's size now is its size before it grew _GROWTH times over at more than _RATE a step, within
    _GROWN_IN steps after step _AFTER), named with ``label``, when more than half of them do and ``also`` holds (on
    ``span.lr``,
    ``top.lr_max``, and ``l.now_loss``, ``l.before_loss``: the median loss of the last 50 steps and of the 50
    before)."""
    return f"""
WITH u AS (SELECT rank, step, parameter, ratio, grad_ratio, lr, norm FROM torch.updates
           WHERE ratio IS NOT NULL AND NOT isnan(ratio)),
-- against the smallest size of the steps before (the latest of equals), and against the measured step before
g AS (SELECT rank, parameter, step, norm,
             min(norm) OVER before AS low, arg_min(step, [norm, -step]) OVER before AS low_at,
             lag(norm) OVER by_step AS prev, lag(step) OVER by_step AS prev_at
      FROM u WHERE norm > 1e-20 AND isfinite(norm) AND step > {_AFTER}
      WINDOW by_step AS (PARTITION BY rank, parameter ORDER BY step),
             before AS (PARTITION BY rank, parameter ORDER BY step
                        RANGE BETWEEN {_GROWN_IN} PRECEDING AND 1 PRECEDING)),
j AS (SELECT rank, parameter, arg_max(norm, step) / min(
          CASE WHEN norm > {_GROWTH} * low AND ln(norm / low) > (step - low_at) * ln(1 + {_RATE}) THEN low
               WHEN norm > {_GROWTH} * prev AND step - prev_at <= {_GROWN_IN}
                    AND ln(norm / prev) > (step - prev_at) * ln(1 + {_RATE}) THEN prev END) AS growth
      FROM g GROUP BY rank, parameter),
-- the updates judged: those taken at a rate within 2x of the latest one (a rate far from it, a schedule's tail or
-- another stage's optimizer, is judged with its own updates)
c AS (SELECT u.* FROM u JOIN (SELECT rank, arg_max(lr, step) AS lr FROM u GROUP BY rank) AS k
      ON k.rank IS NOT DISTINCT FROM u.rank
      WHERE u.lr IS NULL OR k.lr IS NULL OR u.lr BETWEEN 0.5 * k.lr AND 2 * k.lr),
s AS (SELECT rank, step, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age,
             max(step) OVER (PARTITION BY rank) AS last
      FROM (SELECT DISTINCT rank, step FROM c)),
-- and every update of the last 20 steps, from the last one 20 or more steps back (a burst of measured steps, a
-- trace the doctor asked for, measures an update every other step; at any cadence the span reaches 20 steps)
f AS (SELECT rank, max(step) AS first FROM s WHERE step <= last - 20 GROUP BY rank),
w AS (SELECT c.* FROM c JOIN s ON s.rank IS NOT DISTINCT FROM c.rank AND s.step = c.step
      LEFT JOIN f ON f.rank IS NOT DISTINCT FROM s.rank
      WHERE s.age <= {_UPDATES} OR s.step >= coalesce(f.first, s.last - 20)),
p AS (SELECT w.rank, w.parameter, median(w.ratio) AS ratio, median(w.grad_ratio) AS grad_ratio,
             coalesce(any_value(j.growth), 1) AS growth
      FROM w LEFT JOIN j ON j.rank IS NOT DISTINCT FROM w.rank AND j.parameter = w.parameter
      GROUP BY w.rank, w.parameter),
hit AS (SELECT rank, count(*) AS tensors, count(*) FILTER (WHERE {cond}) AS n, median(ratio) AS med,
               string_agg(parameter || ' ' || {label}, ', ' ORDER BY ratio, growth DESC, parameter)
                   FILTER (WHERE {cond}) AS names
        FROM p GROUP BY rank),
span AS (SELECT rank, min(step) AS since, max(step) AS step, count(DISTINCT step) AS steps, arg_max(lr, step) AS lr
         FROM w GROUP BY rank),
-- the highest rate of the steps kept: a schedule that decayed it is not named (the rate is the job's choice)
top AS (SELECT rank, max(lr) AS lr_max FROM torch.steps GROUP BY rank),
l AS (SELECT rank, median(loss) FILTER (WHERE age <= 50) AS now_loss,
             median(loss) FILTER (WHERE age > 50) AS before_loss
      FROM (SELECT rank, loss, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age FROM torch.steps
            WHERE loss IS NOT NULL AND isfinite(loss))
      WHERE age <= 100 GROUP BY rank)
SELECT span.rank, span.step, span.since, span.steps, span.lr, top.lr_max, hit.tensors, hit.n, hit.med,
       l.now_loss, l.before_loss,
       CASE WHEN len(string_split(hit.names, ', ')) > 5
            THEN array_to_string(list_slice(string_split(hit.names, ', '), 1, 5), ', ') || ' and '
                 || (len(string_split(hit.names, ', ')) - 5) || ' more'
            ELSE hit.names END AS names
FROM span JOIN hit ON hit.rank IS NOT DISTINCT FROM span.rank
LEFT JOIN top ON top.rank IS NOT DISTINCT FROM span.rank
LEFT JOIN l ON l.rank IS NOT DISTINCT FROM span.rank
WHERE span.steps >= {_UPDATES} AND span.since > {_AFTER} AND span.step - span.since >= 20 AND 2 * hit.n > hit.tensors
  AND {also} AND {_current("span")}"""


rule(
    "update_too_small",
    family="optimizer",
    severity="warning",
    description=(
        f"Over the last {_UPDATES} measured optimizer steps and those of the last 20 steps (after step {_AFTER}; "
        "those at a rate within 2x of the latest), "
        "more than half the weight tensors "
        f"measured (torch.updates) changed by less than {_SMALL:g} of their size a step (‖Δw‖/‖w‖, ~1e-3 is "
        f"healthy) and by less than {_EFFECTIVE:g} of their gradient before clipping (grad_ratio: a converged model's "
        "small gradients are applied in full), the learning rate at least half the highest of the steps torch.steps "
        "keeps (a schedule that decayed it is not named) and the median loss of the last 50 steps not 2% below that "
        "of the 50 before: the "
        "steps hardly move the weights (gradients clipped far below their norm, or clipped while GradScaler still "
        "scales them, or a rate far too small)."
    ),
    # a rate near the job's top (not a schedule's tail), and a loss that is not falling: a small rate chosen on
    # purpose (a fine-tune at 1e-6) still moves the loss
    sql=_update_size(
        f"ratio < {_SMALL} AND coalesce(ratio < {_EFFECTIVE} * grad_ratio, TRUE)",
        "span.lr > 0 AND (top.lr_max IS NULL OR span.lr >= 0.5 * top.lr_max) AND "
        "coalesce(l.now_loss >= l.before_loss - 0.02 * abs(l.before_loss), TRUE)",
    ),
    message=(
        "the optimizer steps hardly move the weights: on the last {steps} measured steps (steps {since}-{step}) "
        "{n} of {tensors} weight tensors changed by less than 1e-4 of their size a step (median {med:.2g}; about "
        "1e-3 is healthy): {names}; the loss is not falling (median {before_loss:.4g}, then {now_loss:.4g}). "
        "At learning rate {lr:.3g}, the gradients that reach the optimizer are far too "
        "small: clip_grad_norm_ with a max_norm far below the gradients' norm (or before scaler.unscale_), or a rate "
        "far too small for this model."
    ),
    next=[
        _UPDATES_NEXT,
        (
            'probe {target} query "SELECT step, lr, grad_norm FROM torch.steps WHERE measured ORDER BY step DESC '
            'LIMIT 10"'
        ),
    ],
)

rule(
    "update_too_large",
    family="optimizer",
    severity="warning",
    description=(
        f"Over the last {_UPDATES} measured optimizer steps and those of the last 20 steps (after step {_AFTER}; "
        "those at a rate within 2x of the latest), "
        "more than half the weight tensors "
        f"measured (torch.updates) changed by more than {_LARGE:g} of their size a step (‖Δw‖/‖w‖, ~1e-3 is "
        f"healthy), or are {_GROWTH} times as large (norm) as they were within {_GROWN_IN} steps before they grew "
        f"that much at more than {_RATE:.0%} a step (updates of 1e-2 a step, the top of the healthy range, grow them "
        "by 1% a step at most): the steps rewrite the weights, a learning rate far too large."
    ),
    sql=_update_size(
        f"ratio > {_LARGE} OR growth > {_GROWTH}",
        label=f"CASE WHEN growth > {_GROWTH} THEN printf('grew %.3gx', growth) ELSE printf('%.2g', ratio) END",
    ),
    message=(
        "the optimizer steps rewrite the weights: on the last {steps} measured steps (steps {since}-{step}) {n} of "
        "{tensors} weight tensors changed by more than a tenth of their size a step (about 1e-3 is healthy), or grew "
        f"more than {_GROWTH}x at over {_RATE:.0%} a step and stayed that large (a step far too large blows them up, "
        "then each step is small beside them): {names}. The learning rate ({lr:.3g}) is far too large for this "
        "model (Adam's steps are about the rate itself in every element, whatever the gradient): lower it, or warm "
        "it up."
    ),
    next=[
        _UPDATES_NEXT,
        "probe {target} lr --scale 0.1",
    ],
    # the weights it blew up take steps small beside them, and the units they push past zero stay dead
    explains=["update_too_small", "dead_activations"],
)

rule(
    "clip_before_unscale",
    family="optimizer",
    severity="warning",
    description=(
        "clip_grad_norm_ ran on gradients a GradScaler had not unscaled yet, on the last two measured steps "
        "(torch.scaler clip_scaled): it measured their norm multiplied by the scale and clipped them that much too "
        "hard."
    ),
    sql=f"""
WITH c AS (SELECT rank, step, scale, clip_scaled, clip_norm,
                  row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age FROM torch.scaler),
r AS (SELECT rank, max(step) AS step, arg_max(scale, step) AS scale, arg_max(clip_norm, step) AS clip_norm
      FROM c WHERE age <= 2 GROUP BY rank HAVING count(*) = 2 AND bool_and(clip_scaled)),
o AS (SELECT rank, max(step) AS other FROM c WHERE NOT clip_scaled GROUP BY rank)
SELECT r.rank, r.step, r.scale, r.clip_norm, r.clip_norm * r.scale AS seen,
       (SELECT min(c.step) FROM c WHERE c.rank IS NOT DISTINCT FROM r.rank AND c.step > coalesce(o.other, -1)) AS since
FROM r LEFT JOIN o ON o.rank IS NOT DISTINCT FROM r.rank
WHERE {_current("r")}""",
    message=(
        "the gradients are clipped (clip_grad_norm_) while GradScaler still holds them multiplied by its scale "
        "({scale:.0f}), "
        "on every measured step since step {since}: it sees a norm of {seen:.4g} where the gradients' own is "
        "{clip_norm:.4g}, so it clips them {scale:.0f}x too hard and the steps hardly move the weights. Call "
        "scaler.unscale_(optimizer) before clip_grad_norm_ (then scaler.step(optimizer) does not unscale twice)."
    ),
    next=[
        (
            'probe {target} query "SELECT step, scale, clip_scaled, clip_norm FROM torch.scaler ORDER BY step DESC '
            'LIMIT 5"'
        ),
        "probe {target} backtrace",
    ],
    explains=["update_too_small"],
)

rule(
    "loss_scale_collapsed",
    family="optimizer",
    severity="critical",
    description=(
        f"A GradScaler's scale fell over the last {_SCALES} measured steps (torch.scaler) to below 1: the scaler "
        "halves it at each step whose scaled gradients hold an inf or NaN, and skips that step's optimizer step, so "
        "a scale that keeps falling means most steps are skipped (the gradients overflow whatever the scale: an "
        "inf or NaN from the forward pass or the loss). torch.steps counts the steps applied only."
    ),
    sql=f"""
WITH c AS (SELECT rank, step, scale, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
           FROM torch.scaler WHERE scale IS NOT NULL),
r AS (SELECT rank, max(step) AS step, min(step) AS since, arg_min(scale, step) AS first_scale,
             arg_max(scale, step) AS scale
      FROM c WHERE age <= {_SCALES} GROUP BY rank HAVING count(*) = {_SCALES})
SELECT rank, step, since, first_scale, scale, step - since AS applied,
       CASE WHEN scale > 0 THEN CAST(round(log2(first_scale / scale)) AS BIGINT) END AS halvings,
       CASE WHEN scale > 0
            THEN printf('%d halvings over %d optimizer steps applied: %d or more steps were skipped',
                        CAST(round(log2(first_scale / scale)) AS BIGINT), step - since,
                        CAST(round(log2(first_scale / scale)) AS BIGINT))
            ELSE 'down to 0, where every step is skipped' END AS skipped
FROM r
WHERE scale < 1 AND scale < first_scale AND {_current("r")}""",
    message=(
        "the loss scale has collapsed: the GradScaler's scale fell from {first_scale:.3g} at step {since} to "
        "{scale:.3g} at step {step} ({skipped}). The scaler halves it and skips the optimizer step whenever the "
        "scaled gradients hold an inf or NaN, so most steps do not train the model. The gradients overflow whatever "
        "the scale: an inf or NaN comes from the forward pass or the loss (float16 activations past 65504, as from "
        "unnormalized inputs or large logits; a log or a division of 0). Find where, then normalize the inputs, or "
        "compute that part in float32 or bfloat16."
    ),
    next=[
        'probe {target} query "SELECT step, scale FROM torch.scaler ORDER BY step DESC LIMIT 10"',
        'probe {target} query "SELECT step, loss, grad_norm, duration FROM torch.steps ORDER BY step DESC LIMIT 10"',
    ],
    # the skipped steps' losses are inf or NaN while the weights stay finite; their backward passes look like
    # micro-batches of the next applied step; the steps applied at a scale near 0 get gradients of 0
    explains=["loss_nonfinite", "accumulation_erased", "grad_norm_zero"],
)
