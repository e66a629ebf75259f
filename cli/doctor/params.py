"""The doctor's rules about what trains: frozen parameters, gradients the optimizer never applies, a rate or a
gradient of zero, layers whose gradients differ by orders of magnitude, and data-parallel replicas whose
weights differ at the same step (``torch.weight_sums``, compared across ranks in the client: probe issues no
collective). docs/doctor.md lists them.

Thresholds are chosen so that a healthy run gets no finding above ``info``; findings name the tensors by
module prefix (``named``: pure SQL over torch.parameters; each tensor's dotted name gives every
module path above it, and a path is a group when all of its tensors are hit and its parent's are not).
"""

from __future__ import annotations

from probe.diagnosis.rules import rule
from probe.sql.ranks import ranks_phrase


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


# Normalization layers: a model where only these train was frozen by a name filter that missed them (or the
# other way round), the classic "for name, p in model.named_parameters(): if 'bn' not in name" mistake.
_NORMS = (
    "('BatchNorm1d', 'BatchNorm2d', 'BatchNorm3d', 'SyncBatchNorm', 'LayerNorm', 'GroupNorm', 'InstanceNorm1d', "
    "'InstanceNorm2d', 'InstanceNorm3d', 'RMSNorm', 'LlamaRMSNorm', 'T5LayerNorm')"
)

# A parameter counts for mostly_frozen when an optimizer holds it, or when its module has a parameter that trains:
# a frozen network no optimizer holds (a distillation teacher, a frozen backbone left out of the optimizer) is
# frozen on purpose.
_COUNTED = "(coalesce(rank, -1), model, name) IN (SELECT coalesce(rank, -1), model, name FROM counted)"

rule(
    "mostly_frozen",
    family="parameters",
    severity="warning",
    description=(
        "More than half of the parameter tensors (or of their elements) that an optimizer holds or that sit in a "
        "module with a parameter that trains have requires_grad=False (a network no optimizer holds, such as a "
        "distillation teacher, is frozen on purpose and left out); names the frozen modules and those that train, "
        "and says when only normalization layers train."
    ),
    sql=f"""
WITH counted AS (
  SELECT * FROM (
    SELECT *, bool_or(requires_grad) OVER (
                PARTITION BY rank, model, CASE WHEN strpos(name, '.') > 0 THEN regexp_replace(name, '[.][^.]*$', '')
                                               ELSE '' END) AS beside
    FROM torch.parameters)
  WHERE coalesce(in_optimizer, FALSE) OR beside),
{named("frozen", "NOT requires_grad", _COUNTED)},
{named("trains", "requires_grad")},
c AS (SELECT rank, model, count(*) AS tensors, count(*) FILTER (WHERE NOT requires_grad) AS frozen,
             sum(numel) FILTER (WHERE NOT requires_grad) AS frozen_elements, sum(numel) AS elements,
             count(*) FILTER (WHERE requires_grad) AS trainable,
             bool_and(module_type IN {_NORMS}) FILTER (WHERE requires_grad) AS norms_only,
             string_agg(DISTINCT module_type, ', ' ORDER BY module_type) FILTER (WHERE requires_grad) AS train_types
      FROM counted GROUP BY rank, model
      HAVING count(*) FILTER (WHERE NOT requires_grad) > count(*) / 2
          OR sum(numel) FILTER (WHERE NOT requires_grad) > sum(numel) / 2),
aside AS (SELECT rank, model, count(*) AS n FROM torch.parameters WHERE NOT {_COUNTED} GROUP BY rank, model)
SELECT c.rank, c.model, c.tensors, c.frozen, c.frozen_elements, {human("c.frozen_elements")} AS frozen_h,
       {human("c.elements")} AS elements_h, f.names AS frozen_names,
       CASE WHEN c.trainable = 0 THEN '; nothing trains'
            ELSE '; what trains: ' || t.names END ||
       CASE WHEN c.norms_only THEN ': only normalization layers (' || c.train_types
           || ') train, as when a name filter meant to '
                                   || 'freeze or unfreeze them matched the rest instead'
            ELSE '' END AS trains,
       coalesce(' (' || a.n || ' more frozen outside any optimizer and any training module are left out: frozen on '
                || 'purpose)', '') AS aside
FROM c JOIN frozen AS f ON f.rank IS NOT DISTINCT FROM c.rank AND f.model = c.model
LEFT JOIN trains AS t ON t.rank IS NOT DISTINCT FROM c.rank AND t.model = c.model
LEFT JOIN aside AS a ON a.rank IS NOT DISTINCT FROM c.rank AND a.model = c.model""",
    message=(
        "{frozen} of {tensors} parameter tensors of {model} that an optimizer holds or that sit beside ones that "
        "train ({frozen_h} of {elements_h} elements) have requires_grad=False{aside}: {frozen_names}{trains}. "
        "Frozen by mistake?"
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


_TOLERANCE = 1e-7  # relative: float64 sums of the same float32 values agree to ~1e-16; one unsynced step moves ~1e-4
_REPLICA_NAMES_SHOWN = 5

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
                                               ORDER BY m.first), 1, {_REPLICA_NAMES_SHOWN}), ', ')
               || CASE WHEN count(*) > {_REPLICA_NAMES_SHOWN} THEN ' and ' || (count(*) - {_REPLICA_NAMES_SHOWN})
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
