"""The doctor's rules about one process's training: hangs and stalls, NaNs, and the loss (docs/doctor.md lists
them; ``param_rules`` has what trains, ``runtime_rules`` memory, speed, input and activations).

Thresholds are chosen so that a healthy run gets no finding above ``info``: every rule
needs enough steps to compare against and a margin in absolute terms as well as a ratio.
"""

from __future__ import annotations

from probe.sql.ranks import STALL_MIN_S, STALL_PACE

from .params import named
from probe.diagnosis.rules import rule


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

# A job's own pace: ranks.status calls a rank stalled long before PROBE_HUNG_AFTER in a job of 10 ms steps (see
# probe.sql.ranks). A warning, not hung's critical: an evaluation or a checkpoint save between steps is a pause too,
# and the main thread's frame says which it is.
rule(
    "stalled",
    family="hang",
    severity="warning",
    description=(
        f"The process is stalled (ranks.status, the state `probe status` and `probe list` show): no step for "
        f"{STALL_PACE}x the job's own p99 step time (over its last 200 steps) and {STALL_MIN_S} s at least while the "
        "main thread is not running (sleeping or waiting: a running one computes, or waits for a CPU on a loaded "
        "host), though not yet PROBE_HUNG_AFTER (then it is hung's); says where the main thread is; across ranks, "
        "only when no rank waits for it (then stalled_rank names it)."
    ),
    sql="""
SELECT s.rank, s.step, round(s.age_s, 1) AS idle_s, s.pace * 1000 AS p99_ms, s.step_time * 1000 AS med_ms,
       s.age_s / s.pace AS ratio,
       coalesce(b.func || ' (' || b.file || ':' || b.lineno || ')', 'an unknown frame') AS where_main
FROM ranks.status AS s
LEFT JOIN (SELECT rank, func, file, lineno FROM python.backtrace WHERE is_main AND depth = 0) AS b
       ON b.rank IS NOT DISTINCT FROM s.rank
WHERE s.state = 'stalled' AND NOT s.culprit""",
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
    "loss_input_not_logits",
    family="plateau",
    severity="warning",
    description=(
        "The loss function is given probabilities where it expects logits (torch.loss made_by, from the loss's "
        "autograd graph): cross_entropy fed by a softmax, nll_loss fed by a softmax without a log, or "
        "binary_cross_entropy_with_logits fed by a sigmoid. The loss applies its own (log-)softmax or sigmoid, so "
        "the outputs are squashed twice: the loss cannot go below a floor and the gradients shrink."
    ),
    sql="""
SELECT rank, function, made_by,
  CASE WHEN function = 'BinaryCrossEntropyWithLogitsBackward0'
         THEN 'binary_cross_entropy_with_logits (BCEWithLogitsLoss) is given sigmoid outputs, not logits: it applies '
              || 'the sigmoid itself, so every prediction is squashed twice and sits between 0.5 and 0.73; remove the '
              || 'sigmoid before the loss (keep it for predictions only), or use binary_cross_entropy on probabilities'
       WHEN made_by LIKE 'SoftmaxBackward0%'
         THEN 'nll_loss (NLLLoss) is given probabilities from a softmax, not log-probabilities: use log_softmax, or '
              || 'cross_entropy on the logits'
       ELSE 'cross_entropy (CrossEntropyLoss) is given probabilities from a softmax, not logits: it applies '
            || 'log_softmax itself, so the outputs are squashed twice, the loss cannot fall far and the gradients '
            || 'shrink; remove the softmax before the loss (keep it for predictions only)' END AS what
FROM torch.loss
WHERE (function LIKE 'NllLoss%'
       AND (made_by LIKE 'SoftmaxBackward0%' OR made_by LIKE 'LogSoftmaxBackward0 <- SoftmaxBackward0%'))
   OR (function = 'BinaryCrossEntropyWithLogitsBackward0' AND made_by LIKE 'SigmoidBackward0%')""",
    message="{what} (the loss's graph: {function} <- {made_by}).",
    next=[
        'probe {target} query "SELECT function, classes, logits_shape, made_by FROM torch.loss"',
        'probe {target} query "SELECT step, loss FROM torch.steps ORDER BY step DESC LIMIT 20"',
    ],
)

rule(
    "loss_plateau",
    family="plateau",
    severity="info",
    description=(
        "The 50-step mean loss moved by less than 1% over the last 100 steps, and it is not near its floor (it "
        "has not fallen to under 2% of the first 50 kept steps' mean: that is convergence, not a plateau)."
    ),
    sql="""
WITH recent AS (
  SELECT rank, step, loss, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age,
         row_number() OVER (PARTITION BY rank ORDER BY step) AS nth
  FROM torch.steps WHERE isfinite(loss)),
m AS (
  SELECT rank, max(step) AS step, avg(loss) FILTER (WHERE age <= 50) AS now_loss,
         avg(loss) FILTER (WHERE age BETWEEN 51 AND 100) AS before_loss,
         avg(loss) FILTER (WHERE nth <= 50) AS first_loss
  FROM recent GROUP BY rank HAVING count(*) >= 100)
SELECT rank, step, now_loss, before_loss FROM m
WHERE abs(now_loss - before_loss) < 0.01 * abs(before_loss)
  AND NOT (first_loss > 0 AND now_loss >= 0 AND now_loss < 0.02 * first_loss)""",
    message=(
        "the loss has plateaued at {now_loss:.4g} (50-step mean {before_loss:.4g} before): fine if it has converged."
    ),
    next=['probe {target} query "SELECT optimizer, param_group, lr, initial_lr FROM torch.optimizer"'],
)

rule(
    "guard_caught",
    family="nan",
    severity="warning",
    description=(
        "The guard (`probe guard`, PROBE_GUARD) caught a step (torch.guard): a non-finite loss or gradient, or a "
        "spike; says how many, what the last one was, what the guard did, and where its evidence bundle is."
    ),
    sql="""
SELECT rank, count(*) AS n, max(step) AS step, arg_max(reason, step) AS reason, arg_max(taken, step) AS taken,
       coalesce('; its evidence is ' || arg_max(evidence, step) || ' (probe.load_evidence(path).replay(model) '
                || 'replays it)', '; no evidence was written (arm the guard with --evidence DIR)') AS where_evidence
FROM torch.guard WHERE event = 'trigger'
GROUP BY rank""",
    message="the guard caught {n} step(s); the last, step {step}: {reason}; it {taken}{where_evidence}.",
    next=[
        "probe {target} guard",
        'probe {target} query "SELECT step, loss, grad_norm, lr FROM torch.steps WHERE step BETWEEN {step} - 5 AND '
        '{step} + 5 ORDER BY step"',
    ],
)
