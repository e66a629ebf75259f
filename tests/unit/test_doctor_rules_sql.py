"""Rules' SQL on DuckDB over hand-made rows, for conditions no CPU job here reaches quickly."""

from __future__ import annotations

from _doctor import rule_rows


def _lr_zero(history: list) -> list:
    return rule_rows(
        "lr_zero",
        {
            "torch.optimizer": (
                "rank INTEGER, optimizer VARCHAR, param_group INTEGER, params INTEGER, lr DOUBLE",
                [(None, "AdamW", 0, 29, 0.0)],
            ),
            "torch.steps": ("rank INTEGER, step BIGINT, lr DOUBLE", [(None, s, lr) for s, lr in history]),
        },
        messages=True,
    )


def test_lr_zero_says_when_a_schedule_ran_out_before_the_run_did():
    # a rate that was 0 from the start: the plain sentence
    assert _lr_zero([(1, 0.0), (2, 0.0)]) == ["AdamW param group 0 (29 tensors) has learning rate 0."]
    # a cosine schedule that reached 0 at step 5000 of a run that goes on: since when, and that nothing changes since
    hist = [(s, 3e-3 * (5000 - s) / 5000) for s in range(1, 5001)] + [(s, 0.0) for s in range(5001, 5201)]
    (said,) = _lr_zero(hist)
    assert said.startswith(
        "AdamW param group 0 (29 tensors) has learning rate 0 since step 5000, where its schedule "
        "reached 0 after 4999 steps at a positive rate"
    ), said
    assert "its 201 steps since changed nothing" in said


def _loss_nonfinite(rows: list) -> list:
    return rule_rows(
        "loss_nonfinite",
        {
            "torch.steps": (
                "rank INTEGER, step BIGINT, loss DOUBLE, lr DOUBLE, grad_norm DOUBLE",
                [(None, *r) for r in rows],
            )
        },
        messages=True,
    )


def test_loss_nonfinite_names_gradients_that_went_first_and_says_when_nothing_was_measured():
    nan, inf = float("nan"), float("inf")
    healthy = [(s, 1.0, 0.05, 1.0) for s in range(1, 40)]
    # gradients Inf at step 40 with a finite loss, the loss NaN from step 41: the gradients are named, not the data
    (said,) = _loss_nonfinite(healthy + [(40, 1.0, 0.05, inf), (41, nan, 0.05, nan)])
    assert said.startswith(
        "the loss was first seen NaN/Inf at step 41 (step 40 was still finite), 1 step(s) after the "
        "gradients became NaN/Inf at step 40 while its loss was still finite"
    ), said
    # NaN loss and gradients at the same step: nothing came first, so the data is suspected
    (said,) = _loss_nonfinite(healthy + [(40, nan, 0.05, nan)])
    assert "with neither an LR jump nor a gradient-norm spike just before: suspect the data" in said, said
    # the step budget measured no gradient norm in the window: said, instead of claiming there was no spike
    (said,) = _loss_nonfinite([(s, 1.0, 0.05, None) for s in range(1, 40)] + [(40, nan, 0.05, None)])
    assert "just before (the gradient norm was not measured on those steps: PROBE_STEP_BUDGET): suspect" in said, said


def test_loss_nonfinite_names_an_lr_jump_as_the_cause_even_when_the_gradients_it_blew_up_were_measured():
    nan, inf = float("nan"), float("inf")
    healthy = [(s, 1.0, 0.05, 1.0) for s in range(1, 40)]
    # the LR jumps at 40, the gradients go Inf at 42 (measured), the loss NaN at 43: the jump is the root cause
    (said,) = _loss_nonfinite(
        healthy + [(40, 1.0, 1e4, 1.0), (41, 3.0, 1e4, None), (42, 9.0, 1e4, inf), (43, nan, 1e4, nan)]
    )
    assert said.startswith(
        "the loss was first seen NaN/Inf at step 43 (step 42 was still finite), 3 step(s) after the "
        "learning rate jumped 2e+05x (0.05 -> 1e+04) at step 40 (the gradients went NaN/Inf at step 42); "
        "lower it"
    ), said
    # gradients that went bad before the jump are the cause, not the jump
    (said,) = _loss_nonfinite(healthy + [(40, 1.0, 0.05, inf), (41, 2.0, 1e4, None), (42, nan, 1e4, nan)])
    assert "after the gradients became NaN/Inf at step 40 while its loss was still finite" in said, said


def _loss_nonfinite_rows(rows: list) -> list:
    from probe.cli.doctor import next_commands
    from probe.cli.doctor import get_rule

    found = rule_rows(
        "loss_nonfinite",
        {
            "torch.steps": (
                "rank INTEGER, step BIGINT, loss DOUBLE, lr DOUBLE, grad_norm DOUBLE",
                [(None, *r) for r in rows],
            )
        },
    )
    return [(row, next_commands(get_rule("loss_nonfinite").next, dict(row, target="7"))) for row in found]


def test_loss_nonfinite_says_the_onset_it_knows_and_what_fits_when_the_weights_stayed_nan():
    nan, inf = float("nan"), float("inf")
    # given: the loss measured every 10 steps (sampled), finite at 1990, NaN from 2000 on (bad data at 1993), never back
    rows = [(s, 1.0, 0.05, 1.0) for s in range(1000, 2000, 10)] + [(s, nan, 0.05, nan) for s in range(2000, 2060, 10)]
    ((row, nxt),) = _loss_nonfinite_rows(rows)
    said = _loss_nonfinite(rows)[0]
    # then: a range, not a step stated as fact
    assert said.startswith(
        "the loss was first seen NaN/Inf at step 2000 (the last finite loss measured was at step 1990: "
        "it went bad at one of steps 1991-2000, the 9 between were not measured)"
    ), said
    # the cause is the data, the weights most likely NaN: restore, no lr change, no checkpoint of NaN weights
    assert "suspect the data" in said and "Every loss measured since (5 step(s)) is NaN/Inf" in said, said
    assert "restore the last checkpoint written before step 1990 and skip or fix the batch" in said, said
    assert not [n for n in nxt if "lr --scale" in n or " checkpoint " in n], nxt
    assert any("torch.parameters WHERE nan_count + inf_count > 0" in n for n in nxt), nxt
    assert "BETWEEN 1990 AND 2000" in nxt[0], nxt
    # given: every step measured, an LR jump, then the loss NaN once and finite again (a skipped batch)
    rows = [(s, 1.0, 0.05, 1.0) for s in range(1, 40)] + [(40, 1.0, 5.0, 1.0), (41, inf, 5.0, 2.0), (42, 1.1, 5.0, 1.0)]
    said = _loss_nonfinite(rows)[0]
    ((row, nxt),) = _loss_nonfinite_rows(rows)
    assert said.startswith(
        "the loss was first seen NaN/Inf at step 41 (step 40 was still finite), 1 step(s) after the "
        "learning rate jumped 100x"
    ), said
    assert "finite again from step 42: the weights survived it; lower the learning rate" in said, said
    assert [n.split(" ", 2)[2] for n in nxt[1:]] == ["lr --scale 0.1", "checkpoint /tmp/emergency-{rank}-{step}.pt"], (
        nxt
    )


def test_loss_nonfinite_names_a_gradient_norm_spike_before_it():
    nan = float("nan")
    rows = [(s, 1.0, 0.05, 1.0) for s in range(1, 38)] + [
        (38, 1.2, 0.05, 60.0),
        (39, 5.0, 0.05, 2.0),
        (40, nan, 0.05, nan),
    ]
    (said,) = _loss_nonfinite(rows)
    assert said.startswith(
        "the loss was first seen NaN/Inf at step 40 (step 39 was still finite), 2 step(s) after the gradient norm "
        "spiked to 60x its recent "
        "median at step 38; clip gradients or lower the LR"
    ), said


def _rule_over_steps(name: str, losses: list) -> list:
    return rule_rows(
        name,
        {
            "torch.steps": (
                "rank INTEGER, step BIGINT, loss DOUBLE",
                [(None, s, v) for s, v in enumerate(losses, start=1)],
            )
        },
        messages=True,
    )


def test_loss_plateau_is_info_on_a_flat_loss_and_quiet_on_a_falling_one():
    import math

    from probe.cli.doctor import get_rule

    assert get_rule("loss_plateau").severity == "info"  # a converged run plateaus too
    flat = [2.0 + 0.001 * math.sin(s) for s in range(300)]
    (said,) = _rule_over_steps("loss_plateau", flat)
    assert said.startswith("the loss has plateaued at 2 ("), said
    assert not _rule_over_steps("loss_plateau", [2.0 * math.exp(-s / 100) for s in range(300)])
    assert not _rule_over_steps("loss_plateau", flat[:99])  # not enough steps to say
    # a loss that fell from 2.3 to a floor near zero has converged: flat there is not a plateau to report
    converged = (
        [2.3] * 50 + [2.3 * math.exp(-s / 20) for s in range(200)] + [2.5e-4 + 1e-7 * math.sin(s) for s in range(150)]
    )
    assert not _rule_over_steps("loss_plateau", converged)


def test_loss_spike_is_an_outlier_the_loss_came_back_from_not_the_onset_of_a_divergence():
    base = [(None, s, 0.006) for s in range(1, 60)]
    spiked = base + [(None, 60, 0.95)] + [(None, s, 0.007) for s in range(61, 80)]
    diverged = (
        base + [(None, 60, 0.95)] + [(None, s, 0.31) for s in range(61, 80)]
    )  # up 50x and stays: loss_diverging's
    tables = lambda rows: {"torch.steps": ("rank INTEGER, step BIGINT, loss DOUBLE", rows)}  # noqa: E731
    (said,) = rule_rows("loss_spike", tables(spiked), messages=True)
    assert said.startswith("the loss spiked to 0.95 at step 60") and "came back to 0.007" in said, said
    assert rule_rows("loss_spike", tables(diverged), messages=True) == []


def test_parameters_unreadable_warns_that_the_parameter_rules_cannot_see():
    errors = "rank INTEGER, time TIMESTAMP, source VARCHAR, message VARCHAR"
    recent = "SELECT * FROM (VALUES {}) AS t(rank, time, source, message)"
    # given: a table that failed on two parameters just now, another error long ago, and an unrelated error
    rows = rule_rows(
        "parameters_unreadable",
        {
            "probe.errors": recent.format(
                "(0, (current_timestamp - INTERVAL 1 MINUTE)::TIMESTAMP, 'torch.parameters: 0.weight', 'no such op'), "
                "(0, current_timestamp::TIMESTAMP, 'torch.parameters: 0.bias', "
                "'Redistribution from one partial type is unsupported'), "
                "(1, (current_timestamp - INTERVAL 2 HOUR)::TIMESTAMP, 'torch.parameters: 0.weight', 'old'), "
                "(1, current_timestamp::TIMESTAMP, 'torch steps: grad norm', 'unrelated')"
            )
        },
        messages=True,
    )
    # then: one warning, for the rank whose reads fail now
    assert rows == [
        "torch.parameters could not read 2 parameter(s) lately (torch.parameters: 0.bias: Redistribution from one "
        "partial type is unsupported): params_nonfinite and grad_nonfinite cannot see them, so finding nothing "
        "there proves nothing."
    ], rows
    # and a healthy control: no errors, no finding
    assert rule_rows("parameters_unreadable", {"probe.errors": (errors, [])}) == []


def _weight_sums(rule: str, per_step: dict, column: str) -> list:
    """``rule`` over torch.weight_sums rows of two tensors, with ``column`` (checksum or collectives) set from
    {step: [rank 0's value, rank 1's, ...]} and the other one equal everywhere."""
    rows = [
        (r, step, "model", pos, f"{pos}.weight", 64, *((v, 1.0) if column == "checksum" else (1.0, v)))
        for step, per_rank in per_step.items()
        for r, v in enumerate(per_rank)
        for pos in (0, 1)
    ]
    columns = "rank INTEGER, step BIGINT, model VARCHAR, position BIGINT, name VARCHAR, numel BIGINT, checksum DOUBLE"
    return rule_rows(rule, {"torch.weight_sums": (columns + ", collectives DOUBLE", rows)}, messages=True)


def _weights(sums: dict) -> list:
    return _weight_sums("weights_diverged", sums, "checksum")


def _collectives(counts: dict) -> list:
    return _weight_sums("collectives_out_of_step", counts, "collectives")


def test_weights_diverged_says_when_they_last_agreed_or_that_they_never_did_in_what_it_kept():
    (said,) = _weights({16: [1.0, 1.0, 1.0], 32: [2.5, 2.0, 2.0], 48: [3.5, 3.0, 3.0]})
    assert "(rank 0 differs from the others)" in said and "they agreed last at step 16 and differ since step 32" in said
    # the oldest checksum kept already differs: said so, not "agreed last at no step compared"
    (said,) = _weights({16: [1.5, 1.0, 1.0], 32: [2.5, 2.0, 2.0]})
    assert "they differ at every step compared, from step 16 on" in said and "no step compared" not in said, said
    assert "a collective issued on some ranks only" in said
    assert _weights({16: [1.0, 1.0, 1.0], 32: [2.0, 2.0, 2.0]}) == []


def test_collectives_out_of_step_names_the_rank_that_ran_one_more_and_between_which_steps():
    (said,) = _collectives({16: [16, 16, 16], 32: [33, 32, 32], 48: [49, 48, 48]})
    assert said.startswith(
        "the ranks of model's process group ran different collectives (rank 0 differs from the others): by step 48 "
        "they had issued rank 0 49, rank 1 48, rank 2 48 collectives; they had issued as many at step 16 and differ "
        "since step 32."
    ), said
    # two ranks: which one is odd cannot be told; the oldest count kept already differs
    (said,) = _collectives({16: [17, 16], 32: [33, 32]})
    assert "(the ranks disagree)" in said and "they differ at every step compared, from step 16 on" in said, said
    # ranks in step, a group that does not count (NULL), and a step not every rank reached yet: nothing
    assert _collectives({16: [16, 16, 16], 32: [32, 32, 32]}) == []
    assert _collectives({16: [None, None], 32: [None, None]}) == []
    assert _collectives({16: [16, 16], 32: [32]}) == []


def test_loss_input_not_logits_reads_what_made_the_losss_input_from_its_graph():
    torch = __import__("pytest").importorskip("torch")
    from probe.training.capture import loss_logits

    F = torch.nn.functional
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 5)
    x, y = torch.randn(16, 8), torch.randint(0, 5, (16,))
    onehot = F.one_hot(y, 5).float()
    losses = {
        "ce on logits": F.cross_entropy(layer(x), y),
        "ce on a reshaped softmax": F.cross_entropy(layer(x).softmax(-1).view(16, 5), y),
        "nll on log_softmax": F.nll_loss(layer(x).log_softmax(-1), y),
        "nll on log(softmax)": F.nll_loss(layer(x).softmax(-1).log(), y),
        "nll on softmax": F.nll_loss(layer(x).softmax(-1), y),
        "bce with logits on logits": F.binary_cross_entropy_with_logits(layer(x), onehot),
        "bce with logits on a sigmoid": F.binary_cross_entropy_with_logits(torch.sigmoid(layer(x)), onehot) * 2,
        "mse": F.mse_loss(layer(x), onehot),
    }
    said = {}
    for name, loss in losses.items():
        kind = loss_logits(loss)
        row = (None, *kind) if kind else (None, None, None, None, None)
        said[name] = rule_rows(
            "loss_input_not_logits",
            {
                "torch.loss": (
                    "rank INTEGER, function VARCHAR, classes BIGINT, logits_shape VARCHAR, made_by VARCHAR",
                    [row],
                )
            },
            messages=True,
        )
    assert said["ce on logits"] == said["nll on log_softmax"] == said["nll on log(softmax)"] == []
    assert said["bce with logits on logits"] == said["mse"] == []
    (ce,) = said["ce on a reshaped softmax"]
    assert ce.startswith("cross_entropy (CrossEntropyLoss) is given probabilities from a softmax, not logits"), ce
    assert "NllLossBackward0 <- LogSoftmaxBackward0 <- SoftmaxBackward0" in ce, ce
    (nll,) = said["nll on softmax"]
    assert nll.startswith("nll_loss (NLLLoss) is given probabilities from a softmax, not log-probabilities"), nll
    (bce,) = said["bce with logits on a sigmoid"]
    assert "is given sigmoid outputs, not logits" in bce and "<- SigmoidBackward0" in bce, bce


def _frozen(params: list) -> list:
    """mostly_frozen over torch.parameters rows ``(model, name, numel, requires_grad, in_optimizer, module_type)``."""
    return rule_rows(
        "mostly_frozen",
        {
            "torch.parameters": (
                "rank INTEGER, model VARCHAR, name VARCHAR, numel BIGINT, requires_grad BOOLEAN, "
                "in_optimizer BOOLEAN, module_type VARCHAR",
                [(None, *p) for p in params],
            )
        },
        messages=True,
    )


def _linear(model: str, prefix: str, n: int, trains: bool, held: bool) -> list:
    return [(model, f"{prefix}.{w}", n, trains, held, "Linear") for w in ("weight", "bias")]


def test_mostly_frozen_leaves_out_a_frozen_network_no_optimizer_holds():
    student = _linear("student", "0", 100, True, True) + _linear("student", "1", 100, True, True)
    # a distillation teacher, ten times the student, frozen and held by no optimizer: frozen on purpose
    teacher = [p for k in range(10) for p in _linear("teacher", str(k), 1000, False, False)]
    assert _frozen(student + teacher) == []
    # the same teacher kept inside the student's model: its modules have nothing that trains, nothing holds them
    inside = [("student", "teacher." + name, n, g, h, t) for _, name, n, g, h, t in teacher]
    assert _frozen(student + inside) == []
    # frozen by mistake: tensors the optimizer holds (it was given model.parameters()) with requires_grad=False
    held = _linear("student", "0", 100, True, True) + _linear("student", "1", 100, False, True)
    held += _linear("student", "2", 100, False, True)
    (said,) = _frozen(held + inside)
    assert said.startswith(
        "4 of 6 parameter tensors of student that an optimizer holds or that sit beside ones that train (400 of 600 "
        "elements) have requires_grad=False (20 more frozen outside any optimizer and any training module are left "
        "out: frozen on purpose): "
    ), said
    # and a frozen weight beside a bias that trains counts, held by an optimizer or not
    (said,) = _frozen(
        [("m", "4.weight", 256, False, False, "Linear"), ("m", "4.bias", 8, True, True, "Linear")] + inside
    )
    assert "1 of 2 parameter tensors of m" in said and ": 4.weight; what trains: 4.bias." in said, said


def _same_data(losses: dict, ddp_ranks=(0, 1), inputs: dict | None = None, messages: bool = True) -> list:
    """ranks_same_data over ``{rank: [loss of step 1, 2, ...]}`` and ``inputs`` (``{rank: {step: input_hash}}``,
    the measured steps' torch.batches), with torch.ddp rows for ``ddp_ranks``."""
    return rule_rows(
        "ranks_same_data",
        {
            "torch.steps": (
                "rank INTEGER, step BIGINT, loss DOUBLE",
                [(r, s, v) for r, vals in losses.items() for s, v in enumerate(vals, start=1)],
            ),
            "torch.batches": (
                "rank INTEGER, step BIGINT, input_hash VARCHAR",
                [(r, s, h) for r, hashes in (inputs or {}).items() for s, h in hashes.items()],
            ),
            "torch.ddp": ("rank INTEGER, model VARCHAR", [(r, "model") for r in ddp_ranks]),
        },
        messages=messages,
    )


def test_ranks_same_data_needs_every_step_of_the_window_identical_on_every_ddp_rank():
    own = [1.0 + 0.01 * s for s in range(150)]
    other = [v + 1e-7 for v in own]  # one ulp-scale apart: the ranks' own batches
    # the same losses to the bit on both ranks at every one of the last 100 steps: named
    (said,) = _same_data({0: own, 1: list(own)})
    assert said.startswith("the 2 DDP ranks computed bit-identical losses at every one of steps 51-150 (100 steps"), (
        said
    )
    # the same from step 101 only: the window still holds steps where they differed
    assert _same_data({0: own, 1: other[:100] + own[100:]}) == []
    # ranks with their own data, or too few steps, or not data-parallel (tensor parallel ranks share the batch)
    assert _same_data({0: own, 1: other}) == []
    assert _same_data({0: own[:10], 1: own[:10]}) == []
    assert _same_data({0: own, 1: list(own)}, ddp_ranks=()) == []


def test_ranks_same_data_names_one_input_fingerprint_on_every_rank_when_the_losses_differ():
    own = [1.0 + 0.01 * s for s in range(150)]
    other = [v + 1e-3 for v in own]  # dropout seeded per rank: the losses differ at every step
    # rank 0 measured every other step, rank 1 every third: steps 6, 12, ... both measured
    measured = {0: range(2, 151, 2), 1: range(3, 151, 3)}

    def fed(same_from: int, batch=lambda s: f"b{s}") -> dict:
        return {r: {s: batch(s) if s >= same_from else f"r{r}s{s}" for s in steps} for r, steps in measured.items()}

    # one fingerprint on both ranks at each of the last 3 steps both measured: named by it
    (found,) = _same_data({0: own, 1: other}, inputs=fed(100), messages=False)
    assert (found["basis"], found["first"], found["step"], found["steps"]) == ("inputs", 138, 150, 3), found
    (said,) = _same_data({0: own, 1: other}, inputs=fed(100))
    assert said.startswith(
        "the 2 DDP ranks were fed the same input on every rank (one fingerprint in torch.batches; 3 batches in all) "
        "at each of the last 3 steps that they all measured (138, 144, 150): the job trains 2 copies of one shard."
    ), said
    # quiet: fingerprints that differ at one of those steps; too few steps both measured; not data-parallel; one
    # constant input on every rank (same_batch's, not a question of ranks)
    assert _same_data({0: own, 1: other}, inputs=fed(140)) == []
    few = {r: {s: f"b{s}" for s in steps if s > 140} for r, steps in measured.items()}
    assert _same_data({0: own, 1: other}, inputs=few) == []
    assert _same_data({0: own, 1: other}, inputs=fed(100), ddp_ranks=()) == []
    assert _same_data({0: own, 1: other}, inputs=fed(100, batch=lambda s: "constant")) == []
    # both signs: one finding, from the fingerprints
    assert [f["basis"] for f in _same_data({0: own, 1: list(own)}, inputs=fed(0), messages=False)] == ["inputs"]


def test_throughput_regression_takes_an_unknown_cpu_wait_out_of_neither_window():
    def said(recent_wait):
        # 100 steps at 20 ms with 12 ms of CPU wait measured, then 50 at 27 ms: 1.35x slower, not 2x
        rows = [(None, s, 0.020, 0.012) for s in range(1, 101)]
        rows += [(None, s, 0.027, recent_wait) for s in range(101, 151)]
        return rule_rows(
            "throughput_regression",
            {"torch.steps": ("rank INTEGER, step BIGINT, duration DOUBLE, cpu_wait DOUBLE", rows)},
        )

    # no measured step among the last 50: their wait is unknown, so neither window's is taken out
    assert said(None) == []
    # both measured: the job's own time went from 8 ms to 27 ms, more than twice
    assert [round(r["ratio"], 2) for r in said(0.0)] == [1.35]


def test_throughput_regression_needs_the_step_time_itself_to_rise():
    # the same 20 ms steps before and after; the measured CPU wait fell from 12 ms to 2 ms (medians of a few
    # measured steps on a loaded host): the own-time estimate doubles, the job did not get slower
    rows = [(None, s, 0.020, 0.012) for s in range(1, 101)] + [(None, s, 0.020, 0.002) for s in range(101, 151)]
    assert (
        rule_rows(
            "throughput_regression",
            {"torch.steps": ("rank INTEGER, step BIGINT, duration DOUBLE, cpu_wait DOUBLE", rows)},
        )
        == []
    )
