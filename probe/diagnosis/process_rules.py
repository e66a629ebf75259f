"""The doctor's rules about one process's training: hangs, NaNs, the loss, parameters, gradients and
the optimizer (docs/doctor.md lists them; ``runtime_rules`` has memory, speed, input and activations).

Thresholds are chosen so that a healthy run gets no finding above ``info``: every rule
needs enough steps to compare against and a margin in absolute terms as well as a ratio.
"""

from __future__ import annotations

from .naming import human, named
from .rules import rule

__all__: list = []

rule(
    "hung",
    family="hang",
    severity="critical",
    description=(
        "No training step has completed for longer than PROBE_HUNG_AFTER seconds (or the hang watchdog fired); says "
        "where the main thread and every other thread outside the standard library are; across ranks, only when "
        "hung_rank names no culprit."
    ),
    params={"hung_after": "PROBE_HUNG_AFTER"},
    sql="""
SELECT i.rank, i.step, round(epoch(current_timestamp) - epoch(i.last_step_at)) AS idle_s,
       coalesce(b.func || ' (' || b.file || ':' || b.lineno || ')', 'an unknown frame') AS where_main,
       coalesce('; the other threads: ' || o.threads, '') AS where_others
FROM process.info AS i
LEFT JOIN (SELECT rank, func, file, lineno FROM python.backtrace WHERE is_main AND depth = 0) AS b
       ON b.rank IS NOT DISTINCT FROM i.rank
LEFT JOIN (-- each other thread at its innermost frame outside the standard library (a thread is rarely news for
           -- being in threading.wait), threads with no such frame (idle pools) left out
           SELECT rank, string_agg(coalesce(thread_name, 'thread ' || thread_id) || ' in ' || func || ' ('
               || file || ':' || lineno || ')',
                                   ', ' ORDER BY thread_name) AS threads
           FROM (SELECT rank, thread_id, thread_name, arg_min(func, depth) AS func, arg_min(file, depth) AS file,
                        arg_min(lineno, depth) AS lineno
                 FROM python.backtrace
                 WHERE NOT is_main AND coalesce(thread_name, '') NOT LIKE 'probe%'
                   AND (file NOT LIKE '%/lib/python3.%' OR file LIKE '%-packages/%')
                 GROUP BY rank, thread_id, thread_name)
           GROUP BY rank) AS o
       ON o.rank IS NOT DISTINCT FROM i.rank
WHERE i.step IS NOT NULL AND i.state IS DISTINCT FROM 'dead'
  AND (i.state = 'hung' OR epoch(current_timestamp) - epoch(i.last_step_at) > {hung_after})
  -- across ranks, the one the others wait for is hung_rank's finding; the waiting ranks are not news
  AND ((SELECT count(*) FROM process.info) < 2 OR NOT EXISTS (SELECT 1 FROM ranks.hung WHERE culprit))""",
    message=(
        "no step has completed for {idle_s:.0f} s since step {step}; the main thread is in {where_main}{where_others}."
    ),
    next=["probe {target} backtrace", "probe {target} backtrace --native"],
)

# A job's own pace: no step for many times its recent p99 step time (and _PACE_MIN_S at least) is a stall
# long before PROBE_HUNG_AFTER, in a job of 10 ms steps; a job of 30 s steps waits 50 x 30 s. A warning, not
# hung's critical: an evaluation or a checkpoint save between steps is a pause too, and the main thread's frame
# says which it is.
_PACE = 50
_PACE_MIN_S = 10
_PACE_STEPS = 200  # recent steps the p99 is taken over

_PACE_SQL = f"""pace AS (
  SELECT rank, quantile_cont(duration, 0.99) AS p99, median(duration) AS med, count(*) AS n
  FROM (SELECT rank, duration, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
        FROM torch.steps WHERE duration IS NOT NULL)
  WHERE age <= {_PACE_STEPS} GROUP BY rank HAVING count(*) >= 20)"""

rule(
    "stalled",
    family="hang",
    severity="warning",
    description=(
        f"No step has completed for {_PACE}x the job's own p99 step time (over its last {_PACE_STEPS} steps) and "
        f"{_PACE_MIN_S} s at least while the main thread is not running (sleeping or waiting: a running one "
        "computes, or waits for a CPU on a loaded host), though not yet PROBE_HUNG_AFTER (then it is hung's); says "
        "where the main thread is; across ranks, only when no rank waits in a collective (then stalled_rank names "
        "the one they wait for)."
    ),
    params={"hung_after": "PROBE_HUNG_AFTER"},
    sql=f"""
WITH {_PACE_SQL}
SELECT i.rank, i.step, round(epoch(current_timestamp) - epoch(i.last_step_at), 1) AS idle_s, p.p99 * 1000 AS p99_ms,
       p.med * 1000 AS med_ms, (epoch(current_timestamp) - epoch(i.last_step_at)) / p.p99 AS ratio,
       coalesce(b.func || ' (' || b.file || ':' || b.lineno || ')', 'an unknown frame') AS where_main
FROM process.info AS i
JOIN pace AS p ON p.rank IS NOT DISTINCT FROM i.rank
LEFT JOIN (SELECT rank, func, file, lineno FROM python.backtrace WHERE is_main AND depth = 0) AS b
       ON b.rank IS NOT DISTINCT FROM i.rank
LEFT JOIN (SELECT rank, state FROM python.threads WHERE is_main) AS t ON t.rank IS NOT DISTINCT FROM i.rank
WHERE i.step IS NOT NULL AND i.state IS DISTINCT FROM 'dead' AND i.state IS DISTINCT FROM 'hung'
  -- a main thread the kernel counts as running computes (or waits for a CPU on a loaded host): slow, not stalled
  AND t.state IS DISTINCT FROM 'running'
  AND epoch(current_timestamp) - epoch(i.last_step_at) > greatest({_PACE} * p.p99, {_PACE_MIN_S})
  AND epoch(current_timestamp) - epoch(i.last_step_at) <= {{hung_after}}
  AND ((SELECT count(*) FROM process.info) < 2 OR NOT EXISTS (SELECT 1 FROM ranks.latest WHERE in_collective))""",
    message=(
        "no step for {idle_s:.1f} s since step {step}, {ratio:.0f}x this job's own p99 step time ({p99_ms:.1f} ms; "
        "median {med_ms:.1f} ms): it has stalled; the main thread is in {where_main}."
    ),
    next=["probe {target} backtrace", "probe {target} backtrace --native"],
)

rule(
    "loss_nonfinite",
    family="nan",
    severity="critical",
    description=(
        "The loss became NaN or infinite: the first step measured non-finite and the last measured finite (an onset "
        "between unmeasured steps is a range, not a step), whether non-finite gradients, an LR jump or a "
        "gradient-norm spike came just before, and whether the loss stayed non-finite since (then the weights are "
        "most likely NaN: restore a checkpoint, do not save one)."
    ),
    sql="""
WITH s AS (
  SELECT rank, step, loss, lr, grad_norm,
         lr / nullif(lag(lr) OVER (PARTITION BY rank ORDER BY step), 0) AS lr_jump,
         lag(lr) OVER (PARTITION BY rank ORDER BY step) AS prev_lr,
         -- the median over finite values only (a windowed median over a NaN fails in DuckDB 2.0)
         grad_norm / nullif(median(CASE WHEN isfinite(grad_norm) THEN grad_norm END)
                            OVER (PARTITION BY rank ORDER BY step ROWS BETWEEN 50 PRECEDING
                                AND 1 PRECEDING), 0) AS gn_score
  FROM torch.steps),
bad AS (SELECT rank, min(step) AS step FROM s WHERE isnan(loss) OR isinf(loss) GROUP BY rank),
around AS (
  -- the last finite loss measured before the first non-finite one; what the measured losses did since
  SELECT b.rank, b.step,
         max(s.step) FILTER (WHERE isfinite(s.loss) AND s.step < b.step) AS last_ok,
         min(s.step) FILTER (WHERE isfinite(s.loss) AND s.step > b.step) AS finite_again,
         count(*) FILTER (WHERE (isnan(s.loss) OR isinf(s.loss)) AND s.step > b.step) AS bad_since
  FROM bad AS b JOIN s ON s.rank IS NOT DISTINCT FROM b.rank
  GROUP BY b.rank, b.step),
near AS (
  SELECT b.rank, b.step,
         max(s.lr_jump) FILTER (WHERE isfinite(s.lr_jump)) AS lr_jump,
         arg_max(s.step, s.lr_jump) FILTER (WHERE isfinite(s.lr_jump)) AS jump_step,
         arg_max(s.prev_lr, s.lr_jump) FILTER (WHERE isfinite(s.lr_jump)) AS lr_before,
         arg_max(s.lr, s.lr_jump) FILTER (WHERE isfinite(s.lr_jump)) AS lr_after,
         max(s.gn_score) FILTER (WHERE isfinite(s.gn_score)) AS gn_score,
         arg_max(s.step, s.gn_score) FILTER (WHERE isfinite(s.gn_score)) AS spike_step,
         -- gradients that went non-finite while the loss was still finite: a backward that overflowed
         min(s.step) FILTER (WHERE (isnan(s.grad_norm) OR isinf(s.grad_norm)) AND s.step < b.step) AS grad_bad_step,
         count(s.grad_norm) FILTER (WHERE s.step < b.step) AS grad_measured
  FROM bad AS b JOIN s ON s.rank IS NOT DISTINCT FROM b.rank AND s.step BETWEEN b.step - 5 AND b.step
  GROUP BY b.rank, b.step),
found AS (
  SELECT n.*, a.last_ok, a.finite_again, a.bad_since,
         CASE WHEN n.lr_jump >= 10 AND (n.grad_bad_step IS NULL OR n.jump_step <= n.grad_bad_step) THEN 'lr'
              WHEN n.grad_bad_step IS NOT NULL THEN 'grad'
              WHEN n.gn_score >= 10 THEN 'spike'
              ELSE 'data' END AS kind,
         -- every loss measured since the onset is non-finite: the weights are most likely NaN already
         a.finite_again IS NULL AND a.bad_since > 0 AS stuck
  FROM near AS n JOIN around AS a ON a.rank IS NOT DISTINCT FROM n.rank)
SELECT rank, step, last_ok, finite_again, bad_since, lr_jump, jump_step, gn_score, spike_step,
    grad_bad_step, kind, stuck,
       coalesce(least(last_ok, step - 10), step - 10) AS from_step,
       CASE WHEN last_ok IS NULL THEN ' (no finite loss was measured before it)'
            WHEN last_ok = step - 1 THEN printf(' (step %d was still finite)', last_ok)
            ELSE printf(' (the last finite loss measured was at step %d: it went bad at one of steps %d-%d, '
                        'the %d between were not measured)', last_ok, last_ok + 1, step, step - last_ok - 1)
       END AS onset,
       CASE WHEN kind = 'lr' THEN
              printf('%d step(s) after the learning rate jumped %.4gx (%.3g -> %.3g) at step %d%s',
                     step - jump_step, lr_jump, lr_before, lr_after, jump_step,
                     CASE WHEN grad_bad_step IS NOT NULL
                          THEN printf(' (the gradients went NaN/Inf at step %d)', grad_bad_step) ELSE '' END)
            WHEN kind = 'grad' THEN
              printf('%d step(s) after the gradients became NaN/Inf at step %d while its loss was ' ||
                  'still finite: a backward '
                     'overflowed or divided by zero (look for the tensor in ' ||
                         'torch.parameters.grad_norm, or a hook that scales '
                     'gradients)', step - grad_bad_step, grad_bad_step)
            WHEN kind = 'spike' THEN
              printf('%d step(s) after the gradient norm spiked to %.3gx its recent median at step %d',
                     step - spike_step, gn_score, spike_step)
            ELSE 'with neither an LR jump nor a gradient-norm spike just before' ||
                 CASE WHEN grad_measured = 0
                     THEN ' (the gradient norm was not measured on those steps: PROBE_STEP_BUDGET)' ELSE '' END ||
                 ': suspect the data (NaN/Inf inputs or labels) or a numerics bug (log(0), ' ||
                     'division by zero, fp16 overflow)'
       END AS cause,
       CASE WHEN stuck THEN
              printf('. Every loss measured since (%d step(s)) is NaN/Inf: the weights are most likely NaN already '
                     '(torch.parameters nan_count says; params_nonfinite when they are), so a ' ||
                         'checkpoint now would save '
                     'them and a lower LR cannot repair them: restore the last checkpoint written before step %d%s',
                     bad_since, coalesce(last_ok, step),
                     CASE WHEN kind = 'data' THEN ' and skip or fix the batch that did it' ELSE '' END)
            WHEN finite_again IS NOT NULL THEN
              printf('. The loss is finite again from step %d: the weights survived it%s', finite_again,
                     CASE WHEN kind = 'lr' THEN '; lower the learning rate' WHEN kind = 'spike'
                         THEN '; clip gradients or lower the LR'
                          ELSE '' END)
            ELSE CASE WHEN kind = 'lr' THEN '; lower it' WHEN kind = 'spike'
                THEN '; clip gradients or lower the LR' ELSE '' END ||
                 '. No loss measured since yet: whether the weights are NaN, torch.parameters says'
       END AS weights,
       CASE WHEN stuck OR finite_again IS NULL
            THEN 'query "SELECT name, nan_count, inf_count FROM torch.parameters WHERE nan_count + inf_count > 0"'
                END AS next_params,
       CASE WHEN NOT stuck AND kind IN ('lr', 'spike') THEN 'lr --scale 0.1' END AS next_lr,
       CASE WHEN finite_again IS NOT NULL THEN 'checkpoint /tmp/emergency-{rank}-{step}.pt' END AS next_checkpoint
FROM found""",
    message="the loss was first seen NaN/Inf at step {step}{onset}, {cause}{weights}.",
    next=[
        (
            'probe {target} query "SELECT step, loss, grad_norm, lr FROM torch.steps WHERE step BETWEEN {from_step} '
            'AND {step} ORDER BY step"'
        ),
        "probe {target} {next_params}",
        "probe {target} {next_lr}",
        "probe {target} {next_checkpoint}",
    ],
)

rule(
    "grad_nonfinite",
    family="nan",
    severity="critical",
    description="Gradients hold NaN or Inf values right now; names the tensors by module.",
    sql=f"""
WITH {named("bad", "grad_nan + grad_inf > 0")},
c AS (SELECT rank, model, count(*) AS tensors, sum(grad_nan + grad_inf) AS bad, arg_max(name,
    grad_nan + grad_inf) AS worst
      FROM torch.parameters WHERE grad_nan + grad_inf > 0 GROUP BY rank, model)
SELECT c.rank, c.model, c.tensors, c.bad, c.worst, b.names
FROM c JOIN bad AS b ON b.rank IS NOT DISTINCT FROM c.rank AND b.model = c.model""",
    message=(
        "{tensors} parameter tensor(s) of {model} have NaN/Inf gradients ({bad} elements): {names}; most in {worst}."
    ),
    next=['probe {target} query "SELECT name, grad_nan, grad_inf FROM torch.parameters WHERE grad_nan + grad_inf > 0"'],
)

rule(
    "params_nonfinite",
    family="nan",
    severity="critical",
    description="Parameter values hold NaN or Inf: the weights are already ruined; names the tensors by module.",
    sql=f"""
WITH {named("bad", "nan_count + inf_count > 0")},
c AS (SELECT rank, model, count(*) AS tensors, sum(nan_count + inf_count) AS bad, arg_max(name,
    nan_count + inf_count) AS worst
      FROM torch.parameters WHERE nan_count + inf_count > 0 GROUP BY rank, model)
SELECT c.rank, c.model, c.tensors, c.bad, c.worst, b.names
FROM c JOIN bad AS b ON b.rank IS NOT DISTINCT FROM c.rank AND b.model = c.model""",
    message=(
        "{tensors} parameter tensor(s) of {model} hold NaN/Inf values ({bad} elements): {names}; most in {worst}: "
        "resume from a checkpoint taken before the loss went bad."
    ),
    next=['probe {target} query "SELECT step, loss, lr FROM torch.steps ORDER BY step DESC LIMIT 20"'],
)

rule(
    "parameters_unreadable",
    family="parameters",
    severity="warning",
    description=(
        "torch.parameters failed to read some parameters in the last 10 minutes (probe.errors): the parameter rules "
        "(params_nonfinite, grad_nonfinite) cannot see them, so their silence is no clean bill."
    ),
    sql="""
SELECT rank, count(*) AS errors, count(DISTINCT source) AS parameters, arg_max(source, time) AS source,
       arg_max(message, time) AS message
FROM probe.errors
WHERE source LIKE 'torch.parameters%' AND time > current_timestamp - INTERVAL 10 MINUTE
GROUP BY rank""",
    message=(
        "torch.parameters could not read {parameters} parameter(s) lately ({source}: {message}): params_nonfinite "
        "and grad_nonfinite cannot see them, so finding nothing there proves nothing."
    ),
    next=[
        (
            'probe {target} query "SELECT time, source, message FROM probe.errors WHERE source LIKE '
            "'torch.parameters%' ORDER BY time DESC LIMIT 10\""
        )
    ],
)

rule(
    "loss_diverging",
    family="divergence",
    severity="warning",
    description=(
        "The loss's 20-step median has risen well above the lowest it reached (by 1.5x and by 0.1 at least): the "
        "typical step got worse, not one outlier (that is loss_spike)."
    ),
    sql="""
WITH s AS (
  SELECT rank, step, median(loss) OVER (PARTITION BY rank ORDER BY step ROWS 19 PRECEDING) AS m20,
         count(loss) OVER (PARTITION BY rank ORDER BY step ROWS 19 PRECEDING) AS n
  FROM torch.steps WHERE isfinite(loss)),
per AS (
  SELECT rank, min(m20) FILTER (WHERE n = 20) AS best, arg_min(step, m20) FILTER (WHERE n = 20) AS best_step,
         arg_max(m20, step) AS now_loss, max(step) AS step
  FROM s GROUP BY rank)
SELECT rank, step, best, best_step, now_loss FROM per
WHERE now_loss > 1.5 * best AND now_loss - best > 0.1 AND step - best_step >= 20""",
    message=(
        "the loss is diverging: its median over the last 20 measured steps is {now_loss:.4g} at step {step}, up from "
        "{best:.4g} at step {best_step}."
    ),
    next=[
        'probe {target} query "SELECT step, loss, grad_norm, lr FROM torch.steps ORDER BY step DESC LIMIT 20"',
        "probe {target} lr --scale 0.5",
    ],
)

rule(
    "loss_spike",
    family="divergence",
    severity="warning",
    description=(
        "One of the last 100 measured steps has a loss more than 3x the median of the 50 steps before it (and "
        "0.5 above it) and 3x the median of the 10 after it, when there are any: an outlier the loss came back from, "
        "to within 3x of before (a loss that stays up is loss_diverging)."
    ),
    sql="""
WITH s AS (
  SELECT rank, step, loss,
         median(loss) OVER (PARTITION BY rank ORDER BY step ROWS BETWEEN 50 PRECEDING AND 1 PRECEDING) AS med,
         count(loss) OVER (PARTITION BY rank ORDER BY step ROWS BETWEEN 50 PRECEDING AND 1 PRECEDING) AS n,
         median(loss) OVER (PARTITION BY rank ORDER BY step ROWS BETWEEN 1 FOLLOWING AND 10 FOLLOWING) AS after,
         -- recent by measured steps, not step numbers: on a fast loop the budget measures one step in many
         row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
  FROM torch.steps WHERE isfinite(loss))
SELECT rank, arg_max(step, loss / med) AS step, max(loss / med) AS ratio, arg_max(loss, loss / med) AS loss,
       arg_max(med, loss / med) AS med, arg_max(after, loss / med) AS after,
       coalesce(printf('; the steps after it came back to %.4g', arg_max(after, loss / med)), '') AS back
FROM s WHERE n >= 20 AND loss > 3 * med AND loss - med > 0.5 AND age <= 100
  -- it came back down, to near where it was: a loss that stays up is loss_diverging's
  AND (after IS NULL OR (loss > 3 * after AND after < 3 * med + 0.1))
GROUP BY rank""",
    message=(
        "the loss spiked to {loss:.4g} at step {step}, {ratio:.1f}x the median {med:.4g} of the steps before{back}."
    ),
    next=[
        (
            'probe {target} query "SELECT step, loss, grad_norm, lr FROM torch.steps WHERE step BETWEEN {step} - '
            '5 AND {step} + 5 ORDER BY step"'
        )
    ],
)

rule(
    "loss_at_chance",
    family="plateau",
    severity="warning",
    description=(
        "The loss has stopped moving at ln(C), the loss of uniform guessing over C classes (C = the class count of "
        "the loss's own logits, torch.loss; quiet when the loss is not a classification loss)."
    ),
    sql="""
WITH recent AS (
  SELECT rank, step, loss, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
  FROM torch.steps WHERE isfinite(loss)),
m AS (
  SELECT rank, max(step) AS step, avg(loss) FILTER (WHERE age <= 20) AS now_loss,
         avg(loss) FILTER (WHERE age BETWEEN 21 AND 40) AS before_loss
  FROM recent GROUP BY rank HAVING count(*) >= 40),
dims AS (SELECT DISTINCT rank, classes AS c FROM torch.loss WHERE classes IS NOT NULL)
SELECT m.rank, m.step, m.now_loss, arg_min(d.c, abs(ln(d.c) - m.now_loss)) AS classes,
       ln(arg_min(d.c, abs(ln(d.c) - m.now_loss))) AS chance
FROM m JOIN dims AS d ON d.rank IS NOT DISTINCT FROM m.rank
WHERE d.c >= 2 AND abs(m.now_loss - m.before_loss) < 0.02 * m.now_loss
GROUP BY m.rank, m.step, m.now_loss
HAVING abs(ln(arg_min(d.c, abs(ln(d.c) - m.now_loss))) - m.now_loss) < 0.03 * m.now_loss""",
    message=(
        "the loss sits at {now_loss:.3f} ~ ln({classes}) = {chance:.3f}, chance level for {classes} classes: the "
        "model is not learning."
    ),
    next=[
        'probe {target} query "SELECT name, requires_grad, in_optimizer, grad_norm FROM torch.parameters"',
        'probe {target} query "SELECT optimizer, param_group, lr FROM torch.optimizer"',
    ],
)

rule(
    "loss_plateau",
    family="plateau",
    severity="info",
    description="The 50-step mean loss moved by less than 1% over the last 100 steps.",
    sql="""
WITH recent AS (
  SELECT rank, step, loss, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
  FROM torch.steps WHERE isfinite(loss)),
m AS (
  SELECT rank, max(step) AS step, avg(loss) FILTER (WHERE age <= 50) AS now_loss,
         avg(loss) FILTER (WHERE age BETWEEN 51 AND 100) AS before_loss
  FROM recent GROUP BY rank HAVING count(*) >= 100)
SELECT rank, step, now_loss, before_loss FROM m WHERE abs(now_loss - before_loss) < 0.01 * abs(before_loss)""",
    message=(
        "the loss has plateaued at {now_loss:.4g} (50-step mean {before_loss:.4g} before): fine if it has converged."
    ),
    next=['probe {target} query "SELECT optimizer, param_group, lr, initial_lr FROM torch.optimizer"'],
)

# Normalization layers: a model where only these train was frozen by a name filter that missed them (or the
# other way round), the classic "for name, p in model.named_parameters(): if 'bn' not in name" mistake.
_NORMS = (
    "('BatchNorm1d', 'BatchNorm2d', 'BatchNorm3d', 'SyncBatchNorm', 'LayerNorm', 'GroupNorm', 'InstanceNorm1d', "
    "'InstanceNorm2d', 'InstanceNorm3d', 'RMSNorm', 'LlamaRMSNorm', 'T5LayerNorm')"
)

rule(
    "mostly_frozen",
    family="parameters",
    severity="warning",
    description=(
        "More than half of the model's parameter tensors (or of its elements) have requires_grad=False; names the "
        "frozen modules and those that train, and says when only normalization layers train."
    ),
    sql=f"""
WITH {named("frozen", "NOT requires_grad")},
{named("trains", "requires_grad")},
c AS (SELECT rank, model, count(*) AS tensors, count(*) FILTER (WHERE NOT requires_grad) AS frozen,
             sum(numel) FILTER (WHERE NOT requires_grad) AS frozen_elements, sum(numel) AS elements,
             count(*) FILTER (WHERE requires_grad) AS trainable,
             bool_and(module_type IN {_NORMS}) FILTER (WHERE requires_grad) AS norms_only,
             string_agg(DISTINCT module_type, ', ' ORDER BY module_type) FILTER (WHERE requires_grad) AS train_types
      FROM torch.parameters GROUP BY rank, model
      HAVING count(*) FILTER (WHERE NOT requires_grad) > count(*) / 2
          OR sum(numel) FILTER (WHERE NOT requires_grad) > sum(numel) / 2)
SELECT c.rank, c.model, c.tensors, c.frozen, c.frozen_elements, {human("c.frozen_elements")} AS frozen_h,
       {human("c.elements")} AS elements_h, f.names AS frozen_names,
       CASE WHEN c.trainable = 0 THEN '; nothing trains'
            ELSE '; what trains: ' || t.names END ||
       CASE WHEN c.norms_only THEN ': only normalization layers (' || c.train_types
           || ') train, as when a name filter meant to '
                                   || 'freeze or unfreeze them matched the rest instead'
            ELSE '' END AS trains
FROM c JOIN frozen AS f ON f.rank IS NOT DISTINCT FROM c.rank AND f.model = c.model
LEFT JOIN trains AS t ON t.rank IS NOT DISTINCT FROM c.rank AND t.model = c.model""",
    message=(
        "{frozen} of {tensors} parameter tensors of {model} ({frozen_h} of {elements_h} elements) have "
        "requires_grad=False: {frozen_names}{trains}. Frozen by mistake?"
    ),
    next=[
        (
            'probe {target} query "SELECT name, module_type, shape, requires_grad, in_optimizer FROM '
            'torch.parameters ORDER BY name"'
        )
    ],
)

rule(
    "grads_not_optimized",
    family="parameters",
    severity="warning",
    description=(
        "Parameters that require gradients are held by no optimizer: they get gradients but never change; names them "
        "by module."
    ),
    sql=f"""
WITH {named("lost", "requires_grad AND NOT in_optimizer")},
c AS (SELECT rank, model, count(*) AS tensors, sum(numel) AS elements
      FROM torch.parameters WHERE requires_grad AND NOT in_optimizer GROUP BY rank, model)
SELECT c.rank, c.model, c.tensors, c.elements, l.names
FROM c JOIN lost AS l ON l.rank IS NOT DISTINCT FROM c.rank AND l.model = c.model""",
    message=(
        "{tensors} trainable parameter tensor(s) of {model} ({elements} elements) are in no optimizer: {names} "
        "(created after the optimizer, or left out of its param groups)."
    ),
    next=[
        'probe {target} query "SELECT name, requires_grad, in_optimizer FROM torch.parameters WHERE NOT in_optimizer"'
    ],
)

rule(
    "lr_zero",
    family="optimizer",
    severity="warning",
    description=(
        "An optimizer param group has learning rate 0: its parameters never move (and when the job's rate was "
        "positive before, since which step: a run that goes on past the end of its schedule)."
    ),
    sql="""
WITH z AS (
  SELECT rank, max(step) FILTER (WHERE lr > 0) AS last_positive, max(step) AS last FROM torch.steps GROUP BY rank)
SELECT o.rank, o.optimizer, o.param_group, o.params,
       CASE WHEN z.last_positive IS NULL THEN ''
            ELSE ' since step ' || (z.last_positive + 1)
                || ', where its schedule reached 0 after ' || z.last_positive ||
                 ' steps at a positive rate: the run goes on past the end of its schedule (more steps ' ||
                     'than the scheduler''s' ||
                 ' total?) and its ' || (z.last - z.last_positive) || ' steps since changed nothing'
       END AS since
FROM torch.optimizer AS o LEFT JOIN z ON z.rank IS NOT DISTINCT FROM o.rank
WHERE o.lr = 0""",
    message="{optimizer} param group {param_group} ({params} tensors) has learning rate 0{since}.",
    next=["probe {target} lr --set 1e-3 --group {param_group}"],
)

rule(
    "grad_norm_zero",
    family="parameters",
    severity="warning",
    description="The gradient norm was exactly 0 on every one of the last 20 measured steps.",
    sql="""
WITH g AS (
  SELECT rank, step, grad_norm, loss, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
  FROM torch.steps WHERE grad_norm IS NOT NULL)
SELECT rank, max(step) AS step, count(*) AS steps, max(abs(loss)) AS loss,
       CASE WHEN max(abs(loss)) = 0
            THEN ', and so is the loss: a mask or weight removes every sample (a padding mask or ignore_index the ' ||
                'wrong way round), or the model already fits every sample exactly'
            ELSE
                ': the loss does not depend on the trained parameters (detached graph, frozen model, or zero-grad '
                'after backward)'
       END AS cause
FROM g WHERE age <= 20 GROUP BY rank
HAVING count(*) = 20 AND max(grad_norm) = 0""",
    message="the gradient norm is exactly 0 on the last {steps} measured steps{cause}.",
    next=['probe {target} query "SELECT name, requires_grad, grad_norm FROM torch.parameters"'],
)

# Vanishing or exploding gradients by layer: the gradient's size per element (RMS, grad_norm / sqrt(numel))
# of the first and the last layer of a stack of numbered layers (a Sequential or ModuleList: ``0.weight``,
# ``blocks.7.mlp.0.weight``, the first whole-number component of the name). Healthy nets measured 0.02
# (8-layer ReLU MLP at PyTorch's default init, before it learns) to 6 (a 12-block pre-LN GPT); 8 sigmoid
# layers measure 5e-6. Layers without a gradient (frozen) are left out, and an exact 0 is another rule's
# (grad_norm_zero, dead_activations): a ratio needs both ends measured.
_LAYER = "^((?:[^.]+\\.)*?)(\\d+)\\."  # prefix of whole components, then the first all-digit component
_GRAD_RATIO = 1e3  # three orders of magnitude between the first and the last layer, either way
_LAYERS_MIN = 3

rule(
    "grads_by_layer",
    family="parameters",
    severity="warning",
    description=(
        f"Gradients vanish or explode across a stack of at least {_LAYERS_MIN} numbered layers (a Sequential or "
        "ModuleList): per element (grad_norm / sqrt(numel), torch.parameters, read at a step boundary), the first "
        f"layer's gradient is under 1/{_GRAD_RATIO:.0f} or over {_GRAD_RATIO:.0f}x the last layer's, after step 50."
    ),
    sql=f"""
WITH p AS (
  SELECT rank, model, regexp_extract(name, '{_LAYER}', 1) AS stack,
         CAST(regexp_extract(name, '{_LAYER}', 2) AS BIGINT) AS layer, grad_norm, numel
  FROM torch.parameters
  -- a tensor no optimizer steps is grads_not_optimized's finding: its gradient says nothing of the stack's learning
  WHERE requires_grad AND in_optimizer AND isfinite(grad_norm) AND numel > 0 AND regexp_matches(name, '{_LAYER}')),
l AS (
  SELECT rank, model, stack, layer, sqrt(sum(grad_norm * grad_norm) / sum(numel)) AS rms
  FROM p GROUP BY rank, model, stack, layer),
s AS (
  SELECT rank, model, stack, count(*) AS layers, min(layer) AS first, max(layer) AS last,
         arg_min(rms, layer) AS first_rms, arg_max(rms, layer) AS last_rms
  FROM l GROUP BY rank, model, stack HAVING count(*) >= {_LAYERS_MIN}),
t AS (SELECT rank, max(step) AS step FROM torch.steps GROUP BY rank)
SELECT s.rank, t.step, s.model, s.stack, s.stack || s.first AS first_layer, s.stack || s.last AS last_layer,
       s.layers, s.first_rms, s.last_rms, s.first_rms / s.last_rms AS ratio,
       CASE WHEN s.stack = '' THEN s.model ELSE s.model || '.' || rtrim(s.stack, '.') END AS stack_name,
       CASE WHEN s.first_rms < s.last_rms THEN 'vanish' ELSE 'explode' END AS direction,
       CASE WHEN s.first_rms < s.last_rms
            THEN 'the first layers barely learn (saturating activations such as sigmoid or tanh, or too small an '
                 'init, in a deep stack without normalization or residual connections): use ReLU/GELU, '
                 'LayerNorm/BatchNorm, residual connections or a He/Xavier init'
            ELSE 'the first layers take far larger steps than the last (a blown-up layer, unnormalized inputs or '
                 'too large an init): clip gradients (clip_grad_norm_), normalize the inputs, check the init scale'
       END AS advice
FROM s JOIN t ON t.rank IS NOT DISTINCT FROM s.rank
WHERE t.step >= 50 AND s.first_rms > 0 AND s.last_rms > 0
  AND (s.first_rms * {_GRAD_RATIO} < s.last_rms OR s.first_rms > {_GRAD_RATIO} * s.last_rms)""",
    message=(
        "gradients {direction} toward the input of {stack_name}: per element, layer {first_layer}'s gradient is "
        "{ratio:.2g}x layer {last_layer}'s (RMS {first_rms:.2g} against {last_rms:.2g}, over {layers} layers): "
        "{advice}."
    ),
    next=[
        (
            'probe {target} query "SELECT name, numel, grad_norm, grad_norm / sqrt(numel) AS grad_rms FROM '
            "torch.parameters WHERE requires_grad AND name LIKE '{stack}%' ORDER BY name\""
        ),
        'probe {target} query "SELECT step, loss, grad_norm FROM torch.steps ORDER BY step DESC LIMIT 20"',
    ],
)
