"""torch tables of what the optimizers hold: ``torch.optimizer`` (param groups), ``torch.optimizer_steps``
(each optimizer's step, for several optimizers) and ``torch.parameters``.

Built at query time from the objects that ``probe.training.finder`` found (the per-step values
from the step tracker's ring); none of them imports torch: without torch they are empty.
"""

from __future__ import annotations

import sys

from ..training import finder, frameworks, hooks
from .._core.boundary import boundary
from ..util.errorlog import record_error
from .registry import Column, no_rows, table


def _tensor_bytes(value) -> int:
    """Bytes this rank holds of ``value`` (a DTensor's local shard under FSDP2)."""
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        value = frameworks.local(value)
        return value.numel() * value.element_size()
    return 0


def _step_count(state: dict):
    for st in state:
        v = st.get("step")
        if v is not None:
            try:
                return int(v)
            except (TypeError, ValueError, RuntimeError):
                return None
    return None


@table(
    "torch.optimizer",
    "One row per param group of each optimizer found: hyperparameters, size and state memory.",
    columns=[
        Column(
            "optimizer",
            "VARCHAR",
            "Class of the optimizer that owns the param groups (a framework's wrapper is looked through).",
        ),
        Column(
            "name",
            "VARCHAR",
            "Name the optimizer was found under (a global such as optimizer, or trainer.optimizer, "
            "trainer.optimizers[0]).",
        ),
        Column(
            "wrapper",
            "VARCHAR",
            "Class of the framework wrapper the training loop steps (AcceleratedOptimizer, LightningSGD, ...), NULL "
            "when it steps the optimizer itself.",
        ),
        Column("optimizer_id", "BIGINT", "Python id of the optimizer, to tell several apart."),
        Column("param_group", "INTEGER", "Index of the param group."),
        Column(
            "lr",
            "DOUBLE",
            "Learning rate the group's next step uses: the loop's own (loop_lr), or what a `probe lr` override makes "
            "of it.",
        ),
        Column(
            "loop_lr",
            "DOUBLE",
            "The group's lr in param_groups: what the loop or its scheduler set (a held override is applied only "
            "during each step; one put into the scheduler's base rates is in it), read at the same moment as lr.",
        ),
        Column(
            "lr_override",
            "VARCHAR",
            "The `probe lr` override on the group: scale F or set LR held at each step, or 'scale F (scheduler base)' "
            "/ 'set LR (scheduler base)' when a torch scheduler's base rates were changed instead (then lr = loop_lr); "
            "NULL when none.",
        ),
        Column(
            "lr_override_status",
            "VARCHAR",
            "How the override has held: for how many steps, and when the loop rewrote its lr and the override was "
            "re-applied.",
        ),
        Column("initial_lr", "DOUBLE", "Learning rate the scheduler started from, NULL without a scheduler."),
        Column("weight_decay", "DOUBLE", "Weight decay of the group."),
        Column("momentum", "DOUBLE", "Momentum (SGD, RMSprop), NULL when the optimizer has none."),
        Column("beta1", "DOUBLE", "First beta (Adam-like optimizers)."),
        Column("beta2", "DOUBLE", "Second beta (Adam-like optimizers)."),
        Column("eps", "DOUBLE", "Epsilon of the group."),
        Column("params", "INTEGER", "Number of parameter tensors in the group."),
        Column(
            "elements",
            "BIGINT",
            "Number of parameter elements in the group held by this rank (under FSDP2/DTensor, its shards: the model's "
            "count is the sum over the ranks).",
        ),
        Column(
            "state_bytes",
            "BIGINT",
            "Bytes of optimizer state (e.g. Adam's exp_avg and exp_avg_sq) held by this rank for the group's "
            "parameters (under FSDP2, its shards).",
        ),
        Column(
            "step_count",
            "BIGINT",
            "The optimizer's own step counter for the group (from its state), NULL before the first step.",
        ),
        Column(
            "scheduler",
            "VARCHAR",
            "Class of the LR scheduler attached to the optimizer (found globally or through the framework: Lightning's "
            "lr_scheduler_configs, the Trainer's lr_scheduler, accelerate's AcceleratedScheduler looked through), NULL "
            "if none was found.",
        ),
        Column(
            "is_lead",
            "BOOLEAN",
            "Whether this optimizer's steps are the ones counted in torch.steps (with several optimizers in each "
            "iteration: the one that starts it, whose lr torch.steps shows).",
        ),
    ],
    examples=[
        "SELECT optimizer, param_group, lr, initial_lr, weight_decay, beta1, beta2, params, elements, "
        "state_bytes / 1e6 AS state_mb, step_count, scheduler FROM torch.optimizer"
    ],
)
def optimizer(ctx):
    tk = hooks.tracker()
    lead = tk.lead_optimizer() if tk is not None else None
    rows = []
    from ..actions.lroverride import describe

    for found in finder.optimizers():
        opt = found.obj
        overrides = describe(opt)
        scheds = finder.scheduler_for(opt)
        sched = scheds[0].obj if scheds else None
        state = opt.state
        for i, group in enumerate(list(opt.param_groups)):
            params = list(group.get("params", ()))
            states = [state.get(p) or {} for p in params]
            betas = group.get("betas") or (None, None)
            rows.append(
                {
                    "optimizer": type(opt).__name__,
                    "name": found.name,
                    "wrapper": found.wrapper,
                    "optimizer_id": id(opt),
                    "param_group": i,
                    "lr": overrides[i]["lr"] if i in overrides else _num(group.get("lr")),
                    "loop_lr": overrides[i]["loop_lr"] if i in overrides else _num(group.get("lr")),
                    "lr_override": overrides[i]["override"] if i in overrides else None,
                    "lr_override_status": overrides[i]["status"] if i in overrides else None,
                    "initial_lr": _num(group.get("initial_lr")),
                    "weight_decay": _num(group.get("weight_decay")),
                    "momentum": _num(group.get("momentum")),
                    "beta1": _num(betas[0]),
                    "beta2": _num(betas[1]),
                    "eps": _num(group.get("eps")),
                    "params": len(params),
                    "elements": sum(frameworks.local(p).numel() for p in params),
                    "state_bytes": sum(_tensor_bytes(v) for st in states for v in list(st.values())),
                    "step_count": _step_count(states),
                    "scheduler": type(sched).__name__ if sched is not None else None,
                    "is_lead": opt is lead,
                }
            )
    return rows


@table(
    "torch.optimizer_steps",
    "One row per optimizer step of an iteration that steps several optimizers (a GAN's discriminator and "
    "generator): each optimizer's loss, lr and gradient norm; empty while one optimizer steps.",
    columns=[
        Column(
            "step",
            "BIGINT",
            "The torch.steps step this optimizer step belongs to (the step ends after the iteration's last optimizer "
            "step).",
        ),
        Column(
            "position",
            "INTEGER",
            "Place of this optimizer step in the iteration, from 0 (the lead optimizer's first step).",
        ),
        Column(
            "optimizer",
            "VARCHAR",
            "The optimizer's name in torch.optimizer (opt_d, opt_g, trainer.optimizers[1]), else its class.",
        ),
        Column("optimizer_class", "VARCHAR", "Class of the optimizer."),
        Column("ended_at", "TIMESTAMP", "When the optimizer's step returned."),
        Column(
            "loss",
            "DOUBLE",
            "The loss backpropagated since the previous optimizer step (the scalars summed), on every step as "
            "torch.steps.loss; NULL while a device copy has not landed (read without a sync) or when none was noted.",
        ),
        Column(
            "lr",
            "DOUBLE",
            "Learning rate of the optimizer's first param group used by this step (a `probe lr` override included).",
        ),
        Column(
            "grad_norm",
            "DOUBLE",
            "L2 norm of the optimizer's gradients at its step, on the steps the gradient norm's budget allows "
            "(PROBE_GRAD_NORM, as torch.steps.grad_norm); NULL on the others.",
        ),
    ],
    examples=[
        "SELECT step, optimizer, loss, lr, grad_norm FROM torch.optimizer_steps ORDER BY step DESC, position LIMIT 10",
        "SELECT step, MAX(loss) FILTER (WHERE optimizer = 'opt_d') AS d_loss, MAX(loss) FILTER (WHERE optimizer = "
        "'opt_g') "
        "AS g_loss FROM torch.optimizer_steps GROUP BY step ORDER BY step DESC LIMIT 10",
    ],
    kind="ring",
)
def optimizer_steps(ctx):
    out = ("step", "position", "optimizer", "optimizer_class", "ended_at", "loss", "lr", "grad_norm")
    tk = hooks.tracker()
    cycle = tk.cycle if tk is not None else None
    if cycle is None:
        return no_rows(out)
    cols = cycle.snapshot()
    names = {id(f.obj): f.name for f in finder.optimizers()}
    named = [names.get(i) or c for i, c in zip(cols["optimizer_id"].tolist(), cols["optimizer"].tolist())]
    return dict(cols, optimizer=named, optimizer_class=cols["optimizer"])  # the ring's class column, named


def _num(v):
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        return None


@table(
    "torch.parameters",
    "One row per named parameter of each model found, with gradient and NaN/Inf health read on the training thread at "
    "the next step boundary (NULL statistics when none comes within 5 s).",
    columns=[
        Column("model", "VARCHAR", "Name of the root model."),
        Column("name", "VARCHAR", "Dotted parameter name within the model."),
        Column("shape", "VARCHAR", "Shape, e.g. [64, 256]."),
        Column("dtype", "VARCHAR", "Element type, e.g. float32."),
        Column("device", "VARCHAR", "Device, e.g. cpu or cuda:0."),
        Column("numel", "BIGINT", "Number of elements (of the whole parameter, also when it is sharded)."),
        Column(
            "placement",
            "VARCHAR",
            "How a sharded parameter (FSDP2/DTensor) is laid out over the ranks, e.g. Shard(dim=0); NULL for an "
            "ordinary tensor. The statistics of a sharded parameter are this rank's shard's, read without a "
            "collective.",
        ),
        Column(
            "local_numel",
            "BIGINT",
            "Elements this rank holds: numel for an ordinary tensor, its shard's for a sharded one.",
        ),
        Column(
            "module_type", "VARCHAR", "Class name of the module that holds the parameter (e.g. Linear, BatchNorm2d)."
        ),
        Column("requires_grad", "BOOLEAN", "Whether the parameter is trainable."),
        Column("in_optimizer", "BOOLEAN", "Whether a discovered optimizer holds the parameter."),
        Column(
            "grad_norm",
            "DOUBLE",
            "L2 norm of the current .grad (this rank's shard of a sharded parameter), NULL when there is none (e.g. "
            "after zero_grad(set_to_none=True)).",
        ),
        Column(
            "nan_count",
            "BIGINT",
            "NaN elements in the parameter's values (NULL when no step boundary came within 5 s to read them safely).",
        ),
        Column("inf_count", "BIGINT", "Infinite elements in the parameter's values."),
        Column("grad_nan", "BIGINT", "NaN elements in the gradient, NULL without a gradient."),
        Column("grad_inf", "BIGINT", "Infinite elements in the gradient, NULL without a gradient."),
    ],
    examples=[
        "SELECT name, shape, numel, requires_grad, in_optimizer FROM torch.parameters ORDER BY numel DESC LIMIT 10",
        "SELECT model, name, nan_count, inf_count, grad_nan, grad_inf FROM torch.parameters "
        "WHERE nan_count + inf_count > 0 OR grad_nan + grad_inf > 0",
        "SELECT model, COUNT(*) AS tensors, SUM(numel) AS elements, SUM(numel) FILTER (WHERE NOT in_optimizer) AS "
        "not_optimized "
        "FROM torch.parameters GROUP BY model",
    ],
)
def parameters(ctx):
    """Values and gradients are read on the training thread at the next step boundary:
    autograd writes ``.grad`` from its own threads without the GIL, so reading them from
    the server thread while a backward runs can crash the process. Without a boundary
    within PARAMETER_WAIT seconds (a hung step) the rows carry no statistics (NULL)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []

    def rows(stats: bool) -> list:
        in_opt = {id(p) for f in finder.optimizers() for g in list(f.obj.param_groups) for p in g.get("params", ())}
        out = []
        with torch.no_grad():
            for model_name, model, _, _ in finder.models():
                owners = {n: type(m).__name__ for n, m in model.named_modules()}
                for name, p in list(model.named_parameters()):
                    try:
                        row = _param_row(torch, model_name, finder.module_path(name), p, id(p) in in_opt, stats)
                        row["module_type"] = owners.get(name.rpartition(".")[0])
                        out.append(row)
                    except Exception as exc:
                        record_error(f"torch.parameters: {name}", exc)
        return out

    if boundary.last_step is None:
        return rows(True)  # no training loop has stepped: nothing runs backward beside us
    try:
        return boundary.run_at_next_step(lambda: rows(True), PARAMETER_WAIT)
    except TimeoutError:
        return rows(False)


PARAMETER_WAIT = 5.0


def _param_row(torch, model_name, name, p, in_opt, stats: bool = True) -> dict:
    """One parameter's row; a sharded one (FSDP2) is read on its local shard: a reduction of the DTensor
    itself would be a collective issued on this rank alone."""
    data = frameworks.local(p.detach())
    row = {
        "model": model_name,
        "name": name,
        "shape": str(list(p.shape)),
        "dtype": str(p.dtype).replace("torch.", ""),
        "device": str(data.device),
        "numel": p.numel(),
        "placement": frameworks.placement(p),
        "local_numel": data.numel(),
        "requires_grad": p.requires_grad,
        "in_optimizer": in_opt,
    }
    if not stats:
        return row
    floating = data.is_floating_point() or data.is_complex()
    stats = [torch.isnan(data).sum(), torch.isinf(data).sum()] if floating else []
    g = p.grad
    if g is not None and not g.is_sparse:
        g = frameworks.local(g.detach())
        stats += [torch.linalg.vector_norm(g.float()), torch.isnan(g).sum(), torch.isinf(g).sum()]
    values = torch.stack([s.float() for s in stats]).tolist() if stats else []  # one device sync per tensor
    row.update(nan_count=int(values[0]) if floating else 0, inf_count=int(values[1]) if floating else 0)
    if len(values) > (2 if floating else 0):
        k = 2 if floating else 0
        row.update(grad_norm=values[k], grad_nan=int(values[k + 1]), grad_inf=int(values[k + 2]))
    return row
