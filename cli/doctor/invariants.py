"""The doctor's rules over the invariant checks of training (``torch.checks``, recorded on measured steps by
``probe.training.invariants``): an invariant that fails on the last two checks in a row is a finding, named
within a step or two of its onset, with what it is about by name (docs/doctor.md lists them).
"""

from __future__ import annotations

from probe.diagnosis.rules import rule


_IN_A_ROW = 2  # failing checks in a row that make a finding (one could be a step caught mid-change)
_CURRENT = 3  # checked steps (the rank's latest) among which an invariant's last check must be


def _check_rows(check: str) -> str:
    """The next command that shows ``check``'s last rows."""
    return (
        f'probe {{target}} query "SELECT step, invariant, ok, subject, detail FROM torch.checks WHERE invariant = '
        f"'{check}' ORDER BY step DESC LIMIT 10\""
    )


def _failing(check: str) -> str:
    """SQL: per rank, the ``check`` whose last _IN_A_ROW checks all failed, since which step, and its evidence."""
    return f"""
WITH c AS (SELECT rank, step, ok, subject, value, detail, row_number() OVER (PARTITION BY rank
    ORDER BY step DESC) AS age
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
HAVING count(*) = {_IN_A_ROW} AND NOT bool_or(c.ok)
   -- still checked: its last row is among the rank's last {_CURRENT} checked steps (a check that stopped, as when
   -- the model it was about is gone, leaves its last rows behind: they are no finding)
   AND max(c.step) >= (SELECT min(s.step) FROM (SELECT DISTINCT step FROM torch.checks AS k
                                                 WHERE k.rank IS NOT DISTINCT FROM c.rank ORDER BY step DESC
                                                     LIMIT {_CURRENT}) AS s)"""


rule(
    "grads_not_cleared",
    family="optimizer",
    severity="warning",
    description=(
        "A trainable tensor's gradient was never None or zero at any backward between measured optimizer steps, on "
        "the last two checks (torch.checks grads_cleared): gradients accumulate across steps, a missing zero_grad()."
    ),
    sql=_failing("grads_cleared"),
    message=(
        "the gradient of {subject} was never cleared between optimizer steps on the last {failed} measured steps "
        "(since step {since}; {detail}): each backward adds to all the steps' gradients before it, so every step "
        "follows their running sum; call optimizer.zero_grad() once per step, before backward() or after step()."
    ),
    next=[
        _check_rows("grads_cleared"),
        "probe {target} backtrace",
    ],
)

rule(
    "step_without_grads",
    family="optimizer",
    severity="warning",
    description=(
        "The lead optimizer stepped with no gradient on any of its trainable tensors, on the last two measured steps "
        "(torch.checks grads_present): zero_grad() between backward() and step(), or a step with no backward; the "
        "parameters do not move."
    ),
    sql=_failing("grads_present"),
    message=(
        "the optimizer stepped with no gradient on any of its {value:.0f} trainable tensors (from {subject} on) on "
        "the last {failed} measured steps (since step {since}): zero_grad() runs between backward() and step(), or "
        "the step has no backward; nothing trains. Clear the gradients before backward() or after step()."
    ),
    next=[
        _check_rows("grads_present"),
        'probe {target} query "SELECT step, loss, grad_norm, lr FROM torch.steps ORDER BY step DESC LIMIT 10"',
    ],
)

rule(
    "eval_mode_in_training",
    family="activations",
    severity="warning",
    description=(
        "Dropout or batch-norm modules (with trainable parameters, or none) of the model being trained were in eval "
        "mode at the last two measured optimizer steps (torch.checks train_mode); names them."
    ),
    sql=_failing("train_mode"),
    message=(
        "{value:.0f} module(s) of the model being trained were in eval mode at its last {failed} measured steps "
        "(since step {since}): {subject} ({detail}): call model.train() after each evaluation; in eval mode dropout "
        "does nothing and batch norm normalizes with running statistics it no longer updates."
    ),
    next=[
        _check_rows("train_mode"),
        (
            'probe {target} query "SELECT model, name, module_type, requires_grad FROM torch.parameters WHERE '
            "module_type LIKE '%Norm%'\""
        ),
    ],
)

rule(
    "params_not_updated",
    family="optimizer",
    severity="warning",
    description=(
        "Sampled parameter tensors that an optimizer holds, with requires_grad, a non-zero gradient and a learning "
        "rate above 0, did not change at the last two measured steps (torch.checks params_move): their optimizer "
        "never steps, or its update is skipped; names them by module."
    ),
    sql=_failing("params_move"),
    message=(
        "{value:.0f} parameter tensor(s) with a gradient and a learning rate did not change at the optimizer step on "
        "the last {failed} measured steps (since step {since}): {subject} ({detail}): the optimizer holding them "
        "never steps (a second optimizer whose step() is missing?) or skips its update."
    ),
    next=[
        _check_rows("params_move"),
        'probe {target} query "SELECT optimizer, param_group, params, lr, step_count FROM torch.optimizer"',
    ],
)

rule(
    "params_without_grads",
    family="parameters",
    severity="warning",
    description=(
        "Trainable parameter tensors (requires_grad) that the lead optimizer holds got no gradient at its step on the "
        "last two measured steps, while its other tensors did (torch.checks grads_reach): the graph from them to the "
        "loss is cut (a .detach(), a NumPy or .item() round trip, torch.no_grad() in forward) or their module is "
        "never called; names them by module, apart from tensors frozen on purpose."
    ),
    sql=_failing("grads_reach"),
    message=(
        "{value:.0f} trainable parameter tensor(s) the optimizer holds got no gradient at its step on the last "
        "{failed} measured steps (since step {since}), while the others did: {subject} ({detail}): nothing connects "
        "them to the loss (a .detach(), a NumPy or .item() round trip, or torch.no_grad() in forward cuts the graph; "
        "or the forward never calls them); they never train. If they are unused on purpose, freeze them "
        "(requires_grad=False) or leave them out of the optimizer."
    ),
    next=[
        _check_rows("grads_reach"),
        'probe {target} query "SELECT name, requires_grad, in_optimizer, grad_norm FROM torch.parameters"',
    ],
)

rule(
    "frozen_params_updated",
    family="parameters",
    severity="warning",
    description=(
        "Parameter tensors with requires_grad=False that an optimizer holds changed between the last measured steps, "
        "twice in a row (torch.checks frozen_still): momentum or weight decay moves frozen weights whose gradient "
        "was zeroed rather than set to None; names them by module."
    ),
    sql=_failing("frozen_still"),
    message=(
        "{value:.0f} frozen parameter tensor(s) (requires_grad=False) still change at the optimizer's steps on the "
        "last {failed} measured steps (since step {since}): {subject} ({detail}): the optimizer holds them and "
        "momentum or weight decay moves them on a stale zero gradient; set their .grad to None when freezing "
        "(zero_grad(set_to_none=True)), or build the optimizer over the trainable tensors only."
    ),
    next=[
        _check_rows("frozen_still"),
        (
            'probe {target} query "SELECT name, requires_grad, in_optimizer FROM torch.parameters WHERE NOT '
            'requires_grad AND in_optimizer"'
        ),
    ],
)

rule(
    "scheduler_pace",
    family="optimizer",
    severity="warning",
    description=(
        "The lead optimizer's LR scheduler broke its declared pace on the last two measured steps (torch.checks "
        "schedule): stepped more often than its optimizer, a per-step schedule (OneCycleLR, CyclicLR, a warm-up "
        "schedule) stepped once an epoch, or a CosineAnnealingLR past its T_max."
    ),
    sql=_failing("schedule"),
    message=(
        "the LR schedule is off its declared shape since step {since}: {detail}. Step the scheduler once per "
        "optimizer step when its length counts steps, once per epoch when it counts epochs."
    ),
    next=[
        'probe {target} query "SELECT step, lr FROM torch.steps WHERE lr IS NOT NULL ORDER BY step DESC LIMIT 20"',
        'probe {target} query "SELECT optimizer, scheduler, lr, initial_lr, step_count FROM torch.optimizer"',
    ],
)

rule(
    "backward_twice",
    family="optimizer",
    severity="warning",
    description=(
        "A loss graph was backpropagated twice within one optimizer step on the last two measured steps "
        "(torch.checks backward_once): its gradients count twice (backward(retain_graph=True) then backward() again, "
        "or a backward in a helper and again in the loop)."
    ),
    sql=_failing("backward_once"),
    message=(
        "the same loss was backpropagated twice in a step on the last {failed} measured steps (since step {since}; "
        "{detail}): its gradients are added twice; keep one backward() per loss and micro-batch."
    ),
    next=[
        (
            'probe {target} query "SELECT step, invariant, ok, value AS backwards, detail FROM torch.checks WHERE '
            "invariant = 'backward_once' ORDER BY step DESC LIMIT 10\""
        ),
        "probe {target} backtrace",
    ],
)

rule(
    "accumulation_erased",
    family="optimizer",
    severity="warning",
    description=(
        "With several backward passes per optimizer step (gradient accumulation), the gradient was cleared before "
        "every one of them on the last two checks (torch.checks accumulation): zero_grad() runs at every "
        "micro-batch, so each step follows only its last micro-batch."
    ),
    sql=_failing("accumulation"),
    message=(
        "gradient accumulation is undone: {detail} (watched: {subject}; since step {since}): call "
        "optimizer.zero_grad() once per optimizer step, after step(), not at every micro-batch."
    ),
    next=[
        (
            'probe {target} query "SELECT step, invariant, ok, value, detail FROM torch.checks WHERE invariant = '
            "'accumulation' ORDER BY step DESC LIMIT 10\""
        ),
        (
            'probe {target} query "SELECT step, micro_batches, loss FROM torch.steps WHERE measured ORDER BY step '
            'DESC LIMIT 10"'
        ),
    ],
)
