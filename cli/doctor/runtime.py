"""The doctor's rules about how one process runs: memory, speed, the input pipeline, activations, and
the probe itself (docs/doctor.md lists them; ``process_rules`` has hangs, NaNs and the loss, ``param_rules``
what trains).

Thresholds are chosen so that a healthy run gets no finding above ``info``: every rule
needs enough steps to compare against and a margin in absolute terms as well as a ratio.
"""

from __future__ import annotations

from probe.diagnosis.rules import rule


# The last 50 steps per rank that read the training thread's CPU wait (torch.steps.cpu_wait, on measured steps):
# cpu_starved's evidence, and input_bound's estimate of the wait on the steps that did not read it.
WAITED_CTE = """waited AS (
  SELECT rank, step, duration, cpu_wait
  FROM (SELECT rank, step, duration, cpu_wait, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
        FROM torch.steps WHERE cpu_wait IS NOT NULL AND duration > 0)
  WHERE age <= 50)"""

rule(
    "memory_growth",
    family="memory",
    severity="warning",
    description=(
        "After the first 100 steps, the memory in use (torch.steps.memory: CUDA allocated, else RSS; read every "
        "0.1 s, on every step) rose by 16 MB or more from each third of the last 30 seconds to the next (each "
        "third's lowest reading, so the activations of a step in flight do not count), over at least 3 seconds and "
        "30 steps: it grows step over step."
    ),
    sql="""
WITH p AS (
  SELECT rank, step, epoch(ended_at) AS t, memory FROM torch.steps WHERE memory IS NOT NULL AND step > 100),
e AS (SELECT rank, max(t) AS t_end FROM p GROUP BY rank),
q AS (SELECT p.* FROM p JOIN e ON e.rank IS NOT DISTINCT FROM p.rank WHERE p.t >= e.t_end - 30),
b AS (SELECT rank, min(t) AS t0, max(t) AS t1, min(step) AS first, max(step) AS step, count(*) AS n FROM q
    GROUP BY rank),
th AS (
  SELECT q.rank, least(2, floor(3 * (q.t - b.t0) / greatest(b.t1 - b.t0, 1e-9)))::INTEGER AS third, min(q.memory) AS low
  FROM q JOIN b ON b.rank IS NOT DISTINCT FROM q.rank GROUP BY q.rank, third),
w AS (
  SELECT b.rank, b.step, b.first, b.n, b.t1 - b.t0 AS secs,
         max(low) FILTER (WHERE third = 0) AS low0, max(low) FILTER (WHERE third = 1) AS low1,
         max(low) FILTER (WHERE third = 2) AS low2,
         (SELECT arg_max(q.memory, q.t) FROM q WHERE q.rank IS NOT DISTINCT FROM b.rank) AS last
  FROM b JOIN th ON th.rank IS NOT DISTINCT FROM b.rank GROUP BY ALL)
SELECT rank, step, first, secs, low0 / 1e6 AS start_mb, greatest(low2, last) / 1e6 AS end_mb,
       (greatest(low2, last) - low0) / 1e6 / greatest(step - first, 1) AS mb_per_step,
       (greatest(low2, last) - low0) / 1e6 / greatest(secs, 1e-3) AS mb_per_s
FROM w WHERE n >= 30 AND secs >= 3 AND low1 - low0 > 16e6 AND low2 - low1 > 16e6 AND low2 > 1.05 * low0""",
    message=(
        "memory in use grows step over step: {start_mb:.0f} MB -> {end_mb:.0f} MB from step {first} to step {step} "
        "in {secs:.0f} s (~{mb_per_step:.2f} MB a step, {mb_per_s:.1f} MB/s): something keeps tensors alive (a list "
        "of losses kept with their graphs, a growing cache)."
    ),
    next=[
        'probe {target} query "SELECT step, memory, peak_allocated FROM torch.steps ORDER BY step DESC LIMIT 20"',
        'probe {target} query "SELECT * FROM torch.memory"',
        "probe {target} cleanup",
    ],
)

rule(
    "allocator_fragmentation",
    family="memory",
    severity="warning",
    description=(
        "On a CUDA device, the caching allocator had to free its cache and retry an allocation (or raised an "
        "out-of-memory error) while it held at least 1 GiB and a fifth of its reservation that no tensor used: the "
        "free memory is there but in pieces."
    ),
    sql="""
SELECT rank, device, allocated / 2^30 AS allocated_gb, reserved / 2^30 AS reserved_gb, (reserved -
    allocated) / 2^30 AS cached_gb,
       total / 2^30 AS total_gb, alloc_retries AS retries, ooms
FROM torch.memory
WHERE device LIKE 'cuda%' AND reserved > 0 AND (alloc_retries > 0 OR ooms > 0)
  AND reserved - allocated >= greatest(2^30, 0.2 * reserved)""",
    message=(
        "{device}: the caching allocator reserves {reserved_gb:.1f} GiB of {total_gb:.1f} but tensors hold only "
        "{allocated_gb:.1f} GiB; {cached_gb:.1f} GiB sit cached in blocks too small to use, and {retries} "
        "allocation(s) had to free the cache and retry ({ooms} out-of-memory error(s)): fragmentation. "
        "`probe cleanup` returns the cache now; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True at the next start "
        "keeps it from coming back."
    ),
    next=['probe {target} query "SELECT * FROM torch.memory"', "probe {target} cleanup"],
)

rule(
    "throughput_regression",
    family="slow",
    severity="warning",
    description=(
        "The median step time of the last 50 steps is twice (and 10 ms) above the job's own earlier median, the time "
        "the training thread waited for a CPU (torch.steps.cpu_wait: the host's load, not the job's) taken out of "
        "both (of neither when the earlier one holds no measured step); said only once a measured step among the "
        "last 50 tells that wait, and only when the step time itself rose by a quarter (a difference of two medians "
        "of the wait is noisy on a loaded host: an unchanged step time is no regression), so that a busier host is "
        "not read as a slower job."
    ),
    sql="""
WITH s AS (
  SELECT rank, step, duration, cpu_wait, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age,
         row_number() OVER (PARTITION BY rank ORDER BY step) AS nth
  FROM torch.steps WHERE duration IS NOT NULL),
m AS (
  SELECT rank, max(step) AS step, median(duration) FILTER (WHERE age <= 50) AS now_s,
         median(duration) FILTER (WHERE age > 50 AND nth > 10) AS before_s,
         median(cpu_wait) FILTER (WHERE age <= 50) AS now_w,
         median(cpu_wait) FILTER (WHERE age > 50 AND nth > 10) AS before_w,
         count(*) FILTER (WHERE age > 50 AND nth > 10) AS n_before
  FROM s GROUP BY rank),
-- the wait is taken out of both windows or of neither: a window no measured step fell in has an unknown wait,
-- not a zero one (taken out of the earlier window only, it would make an unchanged step time look slower)
w AS (
  SELECT *, CASE WHEN now_w IS NULL OR before_w IS NULL THEN 0 ELSE now_w END AS now_wait,
         CASE WHEN now_w IS NULL OR before_w IS NULL THEN 0 ELSE before_w END AS before_wait FROM m),
j AS (
  SELECT *, greatest(now_s - now_wait, 0) AS now_own, greatest(before_s - before_wait, 1e-6) AS before_own FROM w)
SELECT rank, step, now_s * 1000 AS now_ms, before_s * 1000 AS before_ms, now_s / before_s AS ratio,
       (now_wait - before_wait) * 1000 AS wait_ms FROM j
WHERE n_before >= 20 AND now_w IS NOT NULL AND now_own > 2 * before_own AND now_own - before_own > 0.01
  AND now_s >= 1.25 * before_s""",
    message="steps got {ratio:.1f}x slower: median {now_ms:.1f} ms over the last 50 steps against "
    "{before_ms:.1f} ms before "
    "(waiting for a CPU accounts for {wait_ms:.1f} ms of it).",
    next=[
        "probe {target} backtrace",
        (
            'probe {target} query "SELECT module, stage, AVG(duration) AS avg_s FROM python.torch_trace WHERE step > '
            '(SELECT MAX(step) - 5 FROM python.torch_trace) GROUP BY ALL ORDER BY avg_s DESC LIMIT 10"'
        ),
    ],
)

rule(
    "cpu_starved",
    family="slow",
    severity="info",
    description=(
        "Over the last 50 measured steps the training thread waited for a CPU (torch.steps.cpu_wait) for more than a "
        "quarter of its step time and 5 ms a step: the host is oversubscribed."
    ),
    sql=f"""
WITH {WAITED_CTE}
SELECT rank, max(step) AS step, median(cpu_wait) * 1000 AS wait_ms, median(duration) * 1000 AS step_ms,
       100 * median(cpu_wait) / median(duration) AS pct
FROM waited GROUP BY rank
HAVING count(*) >= 10 AND median(cpu_wait) > 0.25 * median(duration) AND median(cpu_wait) > 0.005""",
    message="the training thread waited {wait_ms:.1f} ms a step for a CPU ({pct:.0f}% of its {step_ms:.1f} ms steps): "
    "other processes, data loader workers or another job share its cores, and the step times include that wait.",
    next=[
        (
            'probe {target} query "SELECT step, duration, cpu_wait FROM torch.steps WHERE cpu_wait IS NOT NULL ORDER '
            'BY step DESC LIMIT 20"'
        )
    ],
)

rule(
    "input_bound",
    family="input",
    severity="warning",
    description=(
        "Over the last 50 steps (every step: torch.steps.data_wait, the time before each step's first forward call; "
        "on traced steps without it, the time outside the root models' forward and backward), more than 70% of the "
        "step time (and 20 ms a step) goes outside the model: waiting for data or host-side work (time waiting for "
        "other ranks, torch.steps.comm_wait, does not count; the time waiting for a CPU, torch.steps.cpu_wait, is "
        "taken out of the model's part and the rest in proportion, since a starved main thread waits while it loads "
        "too, and the 20 ms are of the rest: on the steps the budget did not measure, the CPU wait is the last 50 "
        "measured steps' share of step time; when that wait is over a quarter of the step, the message says both); "
        "summed over the "
        "steps, so batches that arrive in pairs from two workers (a fast step, then a slow one) count in full; names "
        "the DataLoaders with num_workers=0 (torch.dataloaders) and, when the main thread is in one now, the "
        "DataLoader's __next__/fetch or Dataset's __getitem__ it is in (python.backtrace)."
    ),
    sql=f"""
WITH f AS (
  SELECT rank, step, sum(duration) AS model_s FROM python.torch_trace WHERE depth = 0 GROUP BY rank, step),
{WAITED_CTE},
w AS (  -- the share of step time the training thread waited for a CPU, over those steps
  SELECT rank, least(sum(cpu_wait) / nullif(sum(duration), 0), 1) AS share FROM waited GROUP BY rank),
j AS (  -- each step's time in the model: all but its data_wait, else (traced steps) its root modules' time; a
        -- step's CPU wait is its own where it was read, else the recent steps' share of it (a loaded host)
  SELECT s.rank, s.step, s.duration - coalesce(s.comm_wait, 0) AS duration,
         least(coalesce(s.cpu_wait, s.duration * coalesce(w.share, 0)), s.duration) AS wait_s,
         coalesce(s.duration - s.data_wait, f.model_s) AS model_s
  FROM torch.steps AS s
  LEFT JOIN f ON f.rank IS NOT DISTINCT FROM s.rank AND f.step = s.step
  LEFT JOIN w ON w.rank IS NOT DISTINCT FROM s.rank
  WHERE s.duration IS NOT NULL AND coalesce(s.duration - s.data_wait, f.model_s) IS NOT NULL),
m AS (
  SELECT rank, max(step) AS step, count(*) AS steps, avg(duration) AS step_s, avg(least(model_s, duration)) AS model_s,
         avg(wait_s) AS wait_s
  FROM (SELECT *, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age FROM j) WHERE age <= 50
  GROUP BY rank),
-- the time outside the model once the CPU wait is taken out in proportion: the main thread that loads a batch
-- waits for a CPU as the model's part does
o AS (SELECT *, (step_s - model_s) * (1 - least(wait_s / nullif(step_s, 0), 1)) AS own_outside_s FROM m),
-- the evidence: loaders that load on the main thread, and whether the main thread is loading now
d AS (
  SELECT rank, count(*) AS n, string_agg(name || ' (' || coalesce(dataset_type, 'a dataset') || ', batch_size '
                                          || coalesce(batch_size::VARCHAR, 'none') || ')', ', ' ORDER BY name) AS names
  FROM torch.dataloaders WHERE num_workers = 0 GROUP BY rank),
b AS (  -- the innermost frame of the main thread in a Dataset's __getitem__ or a DataLoader's __next__/fetch
  SELECT rank, arg_min(func || ' (' || regexp_extract(file, '[^/]+$') || ':' || lineno || ')', depth) AS frame
  FROM python.backtrace
  WHERE is_main AND (func IN ('__getitem__', '__getitems__')
                     OR (file LIKE '%/torch/utils/data/%' AND func IN ('__next__', '_next_data', 'fetch')))
  GROUP BY rank)
SELECT m.rank, m.step, m.steps, m.step_s * 1000 AS step_ms, m.model_s * 1000 AS model_ms,
       100 * (1 - m.model_s / m.step_s) AS outside_pct, m.own_outside_s * 1000 AS own_outside_ms,
       CASE WHEN m.wait_s > 0.25 * m.step_s AND m.wait_s > 0.005
            THEN '; the host is starved too: the training thread waited ' || round(m.wait_s * 1000, 1)
                 || ' ms a step for a CPU (' || round(100 * m.wait_s / m.step_s)::BIGINT
                 || '% of the step), which slows the loading as much as the model (fewer processes than cores, or a '
                 || 'lighter input pipeline)'
            ELSE '' END AS starved,
       coalesce('; ' || CASE WHEN d.n = 1 THEN 'DataLoader ' ELSE 'DataLoaders ' END || d.names
                || CASE WHEN d.n = 1 THEN ' has' ELSE ' have' END
                || ' num_workers=0: the training thread loads every batch itself '
                   '(give it workers, num_workers=4 or more)', '') AS loaders,
       coalesce('; the main thread is in ' || b.frame || ' now', '') AS loading
FROM o AS m
LEFT JOIN d ON d.rank IS NOT DISTINCT FROM m.rank
LEFT JOIN b ON b.rank IS NOT DISTINCT FROM m.rank
WHERE m.steps >= 3 AND m.model_s < 0.3 * m.step_s AND m.own_outside_s > 0.02""",
    message=(
        "{outside_pct:.0f}% of step time is spent outside forward/backward ({step_ms:.1f} ms a step, {model_ms:.1f} "
        "ms in the model): the input pipeline or host-side work is the bottleneck{loaders}{loading}{starved}."
    ),
    next=[
        "probe {target} backtrace",
        (
            'probe {target} query "SELECT name, dataset_type, batch_size, num_workers, pin_memory, prefetch_factor '
            'FROM torch.dataloaders"'
        ),
        'probe {target} query "SELECT name, state, cpu_user_s, func, lineno FROM python.threads"',
    ],
)

rule(
    "data_spans",
    family="input",
    severity="warning",
    description=(
        "Over the last 20 steps, the script's probe.span('data') blocks take more than 40% of the step time (and "
        "10 ms): the input pipeline is the bottleneck."
    ),
    sql="""
WITH d AS (
  SELECT rank, step, sum(duration) AS data_s FROM python.spans WHERE name = 'data' GROUP BY rank, step),
j AS (
  SELECT s.rank, s.step, s.duration, d.data_s FROM torch.steps AS s
  JOIN d ON d.rank IS NOT DISTINCT FROM s.rank AND d.step = s.step
  WHERE s.duration IS NOT NULL),
m AS (
  SELECT rank, max(step) AS step, count(*) AS steps, median(duration) AS step_s, median(data_s) AS data_s
  FROM (SELECT *, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age FROM j) WHERE age <= 20
  GROUP BY rank)
SELECT rank, step, steps, step_s * 1000 AS step_ms, data_s * 1000 AS data_ms, 100 * data_s / step_s AS data_pct FROM m
WHERE steps >= 3 AND data_s > 0.4 * step_s AND data_s > 0.01""",
    message=(
        "{data_pct:.0f}% of step time is spent in probe.span('data') blocks ({data_ms:.1f} ms of {step_ms:.1f} ms a "
        "step): the input pipeline is the bottleneck (more DataLoader workers, pin_memory, prefetching)."
    ),
    next=[
        "probe {target} trace --steps 5 -o trace.json",
        (
            'probe {target} query "SELECT step, name, duration FROM python.spans WHERE step > (SELECT MAX(step) - '
            '3 FROM python.spans) ORDER BY time"'
        ),
    ],
)

# Activations whose output is exactly 0 over part of their range (ReLU-like; GELU underflows to 0 for
# inputs below about -5.5 in float32). Dropout, SiLU, LeakyReLU and the like are not listed: their
# zeros are by design, or they have none.
_ZEROING = "('ReLU', 'ReLU6', 'GELU', 'Hardswish', 'Threshold')"
_DEAD = 0.95  # share of exact zeros that calls a zeroing activation's output dead (healthy ReLU nets sit near 50%)

rule(
    "dead_activations",
    family="activations",
    severity="warning",
    description=(
        f"On each of its last 3 traced steps, at least {_DEAD:.0%} of a ReLU/GELU-family module's output is exactly "
        "0: its units are dead and pass no gradient."
    ),
    sql=f"""
WITH c AS (
  SELECT rank, model, module, step, any_value(module_type) AS module_type, avg(out_zero_frac) AS zeros,
         any_value(out_shape) AS shape
  FROM python.torch_trace
  WHERE stage = 'forward' AND out_zero_frac IS NOT NULL AND module_type IN {_ZEROING}
  GROUP BY rank, model, module, step),
r AS (SELECT *, row_number() OVER (PARTITION BY rank, model, module ORDER BY step DESC) AS age FROM c)
SELECT rank, max(step) AS step, module, any_value(module_type) AS module_type, count(*) AS steps,
       100 * avg(zeros) AS pct, 100 * min(zeros) AS min_pct, arg_max(shape, step) AS shape
FROM r WHERE age <= 3 GROUP BY rank, model, module
HAVING count(*) = 3 AND min(zeros) >= {_DEAD}""",
    message=(
        "{pct:.1f}% of the output of module {module} ({module_type}, shape {shape}) is exactly 0 on each of its last "
        "{steps} traced steps (to step {step}): its units are dead and pass no gradient; look at the layer before it "
        "(a large negative bias, or an LR that pushed its pre-activations negative)."
    ),
    next=[
        (
            'probe {target} query "SELECT seq, module, module_type, out_mean, out_std, out_zero_frac FROM '
            "python.torch_trace WHERE step = {step} AND stage = 'forward' ORDER BY seq\""
        ),
        'probe {target} query "SELECT name, shape, requires_grad, grad_norm FROM torch.parameters"',
    ],
)

rule(
    "collapsed_output",
    family="activations",
    severity="warning",
    description=(
        "A module's output no longer varies across the batch (std across the first dimension ~ 0 on its last "
        "3 traced steps, after it did vary) while the output of the module called just before it does."
    ),
    sql=f"""
WITH v AS (
  SELECT rank, model, step, seq, depth, module, module_type, out_batch_std AS b, out_mean, out_std, out_zero_frac,
         out_batch_std > 1e-3 * (abs(out_mean) + out_std) AS varies,
         out_batch_std <= 1e-6 * (abs(out_mean) + out_std) AS flat,
         dense_rank() OVER (PARTITION BY rank ORDER BY step DESC) AS age
  FROM python.torch_trace WHERE stage = 'forward' AND out_batch_std IS NOT NULL
      AND isfinite(out_mean) AND isfinite(out_std)),
f AS (SELECT * FROM v WHERE age <= 3 AND flat AND NOT (module_type IN {_ZEROING} AND out_zero_frac >= {_DEAD})),
p AS (  -- the call just before each flat one at its depth or deeper: it ended before the flat call began
  SELECT f.rank, f.model, f.module, f.step, f.seq, any_value(f.module_type) AS module_type, any_value(f.b) AS b,
         arg_max(q.module, q.seq) AS prev, arg_max(q.b, q.seq) AS prev_b, arg_max(q.varies, q.seq) AS prev_varies
  FROM f JOIN v AS q ON q.rank IS NOT DISTINCT FROM f.rank AND q.step = f.step AND q.seq < f.seq AND q.depth >= f.depth
  GROUP BY f.rank, f.model, f.module, f.step, f.seq),
m AS (
  SELECT rank, model, module, any_value(module_type) AS module_type, max(step) AS step,
         count(DISTINCT step) AS steps, bool_and(prev_varies) AS fed, max(b) AS b,
         arg_max(prev, step) AS prev, arg_max(prev_b, step) AS prev_b
  FROM p GROUP BY rank, model, module),
was AS (SELECT rank, model, module, max(b) AS was_b, arg_max(step, b) AS was_step FROM v WHERE varies GROUP BY ALL),
hit AS (
  SELECT m.*, w.was_b, w.was_step FROM m
  JOIN was AS w ON w.rank IS NOT DISTINCT FROM m.rank AND w.model = m.model AND w.module = m.module
  WHERE m.steps = 3 AND m.fed)
SELECT * FROM hit AS h  -- a container whose output collapsed because a module inside it did: name the inner one
WHERE NOT EXISTS (SELECT 1 FROM hit AS i WHERE i.rank IS NOT DISTINCT FROM h.rank AND i.model = h.model
                  AND starts_with(i.module, h.module || '.'))""",
    message=(
        "the output of module {module} ({module_type}) is the same for every sample of the batch on its last {steps} "
        "traced steps (std across the batch {b:.2g}, up to step {step}; it was {was_b:.3g} at step {was_step}), "
        "while its input from {prev} varies (std across the batch {prev_b:.3g}): its weights have collapsed (zeroed, "
        "or a mask that removes them) or it saturates."
    ),
    next=[
        (
            'probe {target} query "SELECT name, shape, requires_grad, grad_norm FROM torch.parameters WHERE name '
            "LIKE '{module}.%'\""
        ),
        (
            'probe {target} query "SELECT step, module, out_mean, out_std, out_batch_std FROM python.torch_trace '
            "WHERE module = '{module}' AND stage = 'forward' ORDER BY step DESC LIMIT 10\""
        ),
    ],
)

rule(
    "host_syncs",
    family="slow",
    severity="warning",
    description=(
        "A line of the training code makes the host wait for the GPU (.item(), .cpu(), .tolist(), printing a CUDA "
        "tensor...) on each of the last 3 traced steps (torch.syncs, CUDA only)."
    ),
    sql="""
WITH s AS (
  SELECT rank, step, file, line, any_value(coalesce(code, '')) AS code, any_value(function) AS function, sum(count) AS n
  FROM torch.syncs WHERE origin = 'user' GROUP BY rank, step, file, line),
t AS (SELECT rank, step, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age FROM torch.steps
      -- traced steps up to the newest one torch.syncs has seen: the tables are snapshotted one after the other, so a
      -- traced step may be in torch.steps before its syncs are in torch.syncs
      WHERE traced AND step <= (SELECT max(x.step) FROM torch.syncs x
          WHERE x.rank IS NOT DISTINCT FROM torch.steps.rank)),
j AS (SELECT s.* FROM s JOIN t ON t.rank IS NOT DISTINCT FROM s.rank AND t.step = s.step WHERE t.age <= 3)
SELECT rank, max(step) AS step, file, regexp_extract(file, '[^/]+$') AS base, line, any_value(code) AS code,
       any_value(function) AS function, count(*) AS steps, sum(n) / count(*) AS per_step
FROM j GROUP BY rank, file, line HAVING count(*) = 3""",
    message=(
        "line {line} of {base} (in {function}) makes the host wait for the GPU {per_step:.0f} time(s) a step on each "
        "of the last {steps} traced steps: `{code}`; the CPU cannot queue the next kernels meanwhile. Keep the value "
        "on the device and read it every N steps."
    ),
    next=[
        (
            'probe {target} query "SELECT step, file, line, code, origin, via, count FROM torch.syncs ORDER BY step '
            'DESC, count DESC LIMIT 20"'
        ),
        "probe {target} trace --steps 5 -o trace.json",
    ],
)

rule(
    "probe_errors",
    family="probe",
    severity="info",
    description="The probe itself caught errors (recorded in probe.errors); training went on.",
    sql=(
        "SELECT rank, count(*) AS n, arg_max(source, time) AS last_source, arg_max(message, time) AS last_message "
        "FROM probe.errors GROUP BY rank"
    ),
    message="the probe recorded {n} error(s) of its own, the last from {last_source}: {last_message}",
    next=['probe {target} query "SELECT time, source, type, message FROM probe.errors ORDER BY time DESC LIMIT 10"'],
)

rule(
    "probe_overhead",
    family="probe",
    severity="info",
    description=(
        "The probe's fixed per-step work (torch.steps.probe_us, median over the last 200 steps) exceeds 2 % of the "
        "step time: steps too short for PROBE_STEP_BUDGET."
    ),
    sql="""
WITH s AS (
  SELECT rank, step, probe_us, duration, measured,
         row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
  FROM torch.steps WHERE probe_us IS NOT NULL AND duration > 0)
SELECT rank, count(*) AS n, median(probe_us) AS probe_us, median(duration) * 1000 AS step_ms,
       median(probe_us) * 1e-6 / median(duration) AS share, avg(measured::INT) AS measured
FROM s WHERE age <= 200 GROUP BY rank
HAVING count(*) >= 50 AND median(probe_us) * 1e-6 / median(duration) > 0.02""",
    message="the probe's own work is {probe_us:.1f} us of every {step_ms:.2f} ms step ({share:.1%}), "
    "more than its budget: "
    "steps this short get their loss, grad norm and peak memory measured on {measured:.1%} of steps.",
    next=[
        'probe {target} query "SELECT step, duration, probe_us, measured FROM torch.steps ORDER BY step DESC LIMIT 20"'
    ],
)
