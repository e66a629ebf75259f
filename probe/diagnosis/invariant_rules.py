"""The doctor's rules over the invariant checks of training (``torch.checks``, recorded on measured steps by
``probe.training.invariants``): an invariant that fails on the last two checks in a row is a finding, named
within a step or two of its onset, with what it is about by name (docs/doctor.md lists them).
"""

from __future__ import annotations

from .rules import rule

__all__: list = []

_IN_A_ROW = 2  # failing checks in a row that make a finding (one could be a step caught mid-change)


def _failing(check: str) -> str:
    """SQL: per rank, the ``check`` whose last _IN_A_ROW checks all failed, since which step, and its evidence."""
    return f"""
WITH c AS (SELECT rank, step, ok, subject, value, detail, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
           FROM torch.checks WHERE invariant = '{check}'),
r AS (SELECT rank, max(step) FILTER (WHERE ok) AS last_ok FROM c GROUP BY rank)
SELECT c.rank, max(c.step) AS step, arg_max(c.subject, c.step) AS subject, arg_max(c.value, c.step) AS value,
       arg_max(c.detail, c.step) AS detail,
       (SELECT min(x.step) FROM c AS x WHERE x.rank IS NOT DISTINCT FROM c.rank AND NOT x.ok
          AND x.step > coalesce(r.last_ok, -1)) AS since,
       (SELECT count(*) FROM c AS x WHERE x.rank IS NOT DISTINCT FROM c.rank AND NOT x.ok
          AND x.step > coalesce(r.last_ok, -1)) AS failed
FROM c JOIN r ON r.rank IS NOT DISTINCT FROM c.rank
WHERE c.age <= {_IN_A_ROW}
GROUP BY c.rank, r.last_ok
HAVING count(*) = {_IN_A_ROW} AND NOT bool_or(c.ok)"""


rule(
    "grads_not_cleared", family="optimizer", severity="warning",
    description="A trainable tensor's gradient was never None or zero at any backward between measured optimizer steps, on the last two checks (torch.checks grads_cleared): gradients accumulate across steps, a missing zero_grad().",
    sql=_failing("grads_cleared"),
    message="the gradient of {subject} was never cleared between optimizer steps on the last {failed} measured steps (since step {since}; {detail}): each backward adds to all the steps' gradients before it, so every step follows their running sum; call optimizer.zero_grad() once per step, before backward() or after step().",
    next=["probe {target} query \"SELECT step, invariant, ok, subject, detail FROM torch.checks WHERE invariant = 'grads_cleared' ORDER BY step DESC LIMIT 10\"",
          "probe {target} backtrace"],
)

rule(
    "step_without_grads", family="optimizer", severity="warning",
    description="The lead optimizer stepped with no gradient on any of its trainable tensors, on the last two measured steps (torch.checks grads_present): zero_grad() between backward() and step(), or a step with no backward; the parameters do not move.",
    sql=_failing("grads_present"),
    message="the optimizer stepped with no gradient on any of its {value:.0f} trainable tensors (from {subject} on) on the last {failed} measured steps (since step {since}): zero_grad() runs between backward() and step(), or the step has no backward; nothing trains. Clear the gradients before backward() or after step().",
    next=["probe {target} query \"SELECT step, invariant, ok, subject, detail FROM torch.checks WHERE invariant = 'grads_present' ORDER BY step DESC LIMIT 10\"",
          "probe {target} query \"SELECT step, loss, grad_norm, lr FROM torch.steps ORDER BY step DESC LIMIT 10\""],
)

rule(
    "eval_mode_in_training", family="activations", severity="warning",
    description="Dropout or batch-norm modules (with trainable parameters, or none) of the model being trained were in eval mode at the last two measured optimizer steps (torch.checks train_mode); names them.",
    sql=_failing("train_mode"),
    message="{value:.0f} module(s) of the model being trained were in eval mode at its last {failed} measured steps (since step {since}): {subject} ({detail}): call model.train() after each evaluation; in eval mode dropout does nothing and batch norm normalizes with running statistics it no longer updates.",
    next=["probe {target} query \"SELECT step, invariant, ok, subject, detail FROM torch.checks WHERE invariant = 'train_mode' ORDER BY step DESC LIMIT 10\"",
          "probe {target} query \"SELECT model, name, module_type, requires_grad FROM torch.parameters WHERE module_type LIKE '%Norm%'\""],
)
