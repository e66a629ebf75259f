"""The rules over what measured steps' data, update and loss scaling were (probe/diagnosis/signal_rules.py) on
hand-made torch.batches, torch.updates and torch.scaler rows: each needs a run of measured steps in a row at the
rank's latest, and says since which step the run goes."""

from __future__ import annotations

from _doctor import rule_rows

BATCHES = (
    "rank INTEGER, step BIGINT, time DOUBLE, input_hash VARCHAR, target_hash VARCHAR, samples DOUBLE, labels DOUBLE, "
    "top_label DOUBLE, top_share DOUBLE"
)
UPDATES = (
    "rank INTEGER, step BIGINT, time DOUBLE, parameter VARCHAR, ratio DOUBLE, grad_ratio DOUBLE, lr DOUBLE, norm DOUBLE"
)
SCALER = "rank INTEGER, step BIGINT, time DOUBLE, scale DOUBLE, clip_scaled BOOLEAN, clip_norm DOUBLE"


def _steps(last: int, lr: float = 0.1, loss: str = "1.0") -> str:
    """torch.steps up to ``last``, every step measured, at rate ``lr`` and loss ``loss`` (SQL over ``range``)."""
    return (
        f"SELECT NULL::INTEGER AS rank, range AS step, TRUE AS measured, {lr} AS lr, {loss} AS loss "
        f"FROM range(1, {last + 1})"
    )


def _batches(rows, last=None):
    last = last or max(r[1] for r in rows)
    return rule_rows("same_batch", {"torch.batches": (BATCHES, rows), "torch.steps": _steps(last)})


def test_same_batch_names_one_fingerprint_at_every_recent_measured_step_since_it_began():
    # given: distinct batches up to step 40, then the same one at every other step from 42 to 80
    rows = [(None, s, 0.0, f"in{s}", f"t{s}", 32.0, 10.0, 1.0, 0.2) for s in range(1, 41)]
    rows += [(None, s, 0.0, "fixed", "labels", 32.0, 10.0, 1.0, 0.2) for s in range(42, 81, 2)]
    (f,) = _batches(rows)
    assert (f["step"], f["since"], f["steps"], f["fingerprint"]) == (80, 42, 20, "fixed")
    # quiet: fresh batches; one batch repeated twice; a run of 10 measured steps over fewer than 10 steps
    assert not _batches(rows[:40])
    assert not _batches(rows[:40] + [(None, 41, 0.0, "in40", "t40", 32.0, 10.0, 1.0, 0.2)])
    assert not _batches(rows[:30] + [(None, s, 0.0, "x", "y", 32.0, 10.0, 1.0, 0.2) for s in range(31, 40)])
    # rows that stopped (the model they were about is gone) are no finding
    assert not _batches(rows, last=90)
    # the same inputs with new targets each step are not one batch
    assert not _batches([(None, s, 0.0, "fixed", f"t{s}", 32.0, 10.0, 1.0, 0.2) for s in range(1, 41)])


def _labels(rows):
    return rule_rows("single_class_batches", {"torch.batches": (BATCHES, rows), "torch.steps": _steps(rows[-1][1])})


def test_single_class_batches_tells_constant_labels_from_batches_sorted_by_class():
    mixed = [(None, s, 0.0, f"i{s}", f"t{s}", 32.0, 10.0, 3.0, 0.2) for s in range(1, 31)]
    # constant: every batch all class 0
    (f,) = _labels(mixed + [(None, s, 0.0, f"i{s}", f"t{s}", 32.0, 1.0, 0.0, 1.0) for s in range(31, 51)])
    assert (f["since"], f["steps"], f["classes"], f["label"]) == (31, 20, 1, 0)
    assert f["what"].startswith("every target is class 0: the labels are constant"), f
    # sorted: each batch one class, the class moving on every few batches
    (f,) = _labels(mixed + [(None, s, 0.0, f"i{s}", f"t{s}", 32.0, 1.0, float(s // 4), 1.0) for s in range(31, 51)])
    assert f["classes"] > 1 and "ordered by class and not shuffled" in f["what"], f
    # quiet: mixed batches; a few single-class batches among them; tiny batches (fewer than 8 targets)
    assert not _labels(mixed)
    assert not _labels(mixed + [(None, s, 0.0, "i", "t", 32.0, 1.0, 0.0, 1.0) for s in range(31, 36)])
    assert not _labels(mixed + [(None, s, 0.0, "i", "t", 4.0, 1.0, 0.0, 1.0) for s in range(31, 51)])


def _updates(rule, ratios: dict, steps=range(60, 110, 10), lr=0.1, lr_max=0.1, loss="1.0"):
    rows = [(None, s, 0.0, name, r, 0.01, lr, 1.0) for s in steps for name, r in ratios.items()]
    return rule_rows(rule, {"torch.updates": (UPDATES, rows), "torch.steps": _steps(max(steps), lr_max, loss)})


def test_update_size_names_the_tensors_far_below_or_above_a_healthy_ratio():
    tiny = {"features.0.weight": 1e-7, "features.3.weight": 2e-7, "classifier.weight": 3e-3}
    (f,) = _updates("update_too_small", tiny)
    assert (f["since"], f["step"], f["n"], f["tensors"]) == (60, 100, 2, 3), f
    assert f["names"] == "features.0.weight 1e-07, features.3.weight 2e-07", f
    assert not _updates("update_too_large", tiny)
    (f,) = _updates("update_too_large", {"a.weight": 0.5, "b.weight": 0.3, "c.weight": 1e-3})
    assert f["names"] == "b.weight 0.3, a.weight 0.5", f
    # quiet: healthy ratios; one tensor in three tiny (a layer barely used); before step 50 (a warm-up's first
    # rates); a rate decayed to under half its top (a schedule's end); fewer than 5 measured updates
    healthy = {"a.weight": 1e-3, "b.weight": 3e-4, "c.weight": 2e-3}
    assert not _updates("update_too_small", healthy) and not _updates("update_too_large", healthy)
    assert not _updates("update_too_small", {"a.weight": 1e-7, "b.weight": 1e-3, "c.weight": 1e-3})
    assert not _updates("update_too_small", tiny, steps=range(10, 60, 10))
    assert not _updates("update_too_small", tiny, lr=0.01, lr_max=0.1)
    assert not _updates("update_too_small", tiny, steps=range(60, 100, 10))
    # a burst of measured steps (the doctor's own trace) measures an update every other step: the last 20 steps count
    assert _updates("update_too_small", tiny, steps=[*range(60, 100, 10), *range(100, 112, 2)])
    # and at any cadence: every third step (the last 20 steps then hold no update exactly 20 steps back, the one
    # before them starts the span)
    assert _updates("update_too_small", tiny, steps=[*range(60, 100, 10), *range(100, 130, 3)])
    assert _updates("update_too_large", {"a.weight": 0.5, "b.weight": 0.3}, steps=range(60, 200, 3))
    # nor for the updates a rate far from the latest took (a schedule decayed to its tail, then a new optimizer or
    # stage at its own rate): each rate's updates are judged with it
    rows = [(None, s, 0.0, n, 1e-7, 0.01, 1e-3, 1.0) for s in range(60, 160, 10) for n in ("a.weight", "b.weight")]
    rows += [(None, s, 0.0, n, 1e-3, 0.01, 0.1, 1.0) for s in (160, 170) for n in ("a.weight", "b.weight")]
    assert not rule_rows("update_too_small", {"torch.updates": (UPDATES, rows), "torch.steps": _steps(170, 0.1)})
    # nor for a converged model: its gradients are small, and its step applies them in full
    rows = [(None, s, 0.0, n, 1e-6, 1e-5, 0.1, 1.0) for s in range(60, 110, 10) for n in ("a.weight", "b.weight")]
    assert not rule_rows("update_too_small", {"torch.updates": (UPDATES, rows), "torch.steps": _steps(100)})
    # nor while the loss falls (a small rate chosen on purpose still moves it)
    assert not _updates("update_too_small", tiny, loss="10.0 - range * 0.05")
    assert _updates("update_too_small", tiny, loss="1.0 + 0.01 * (range % 3)")


def _grown(norms: dict, steps=range(60, 420, 60)):
    """update_too_large over measured updates at ``steps`` whose weights' norms are ``norms[name](step)``, each step
    moving them by 1e-3 of their size."""
    rows = [(None, s, 0.0, name, 1e-3, 0.01, 1.0, f(s)) for s in steps for name, f in norms.items()]
    return rule_rows("update_too_large", {"torch.updates": (UPDATES, rows), "torch.steps": _steps(max(steps))})


def test_update_too_large_names_weights_an_update_blew_up_and_that_stayed_large():
    # Adam at a rate of 1: the weights grow 30-100x within the few steps after 150, then each step is small
    blown = {"a.weight": lambda s: 1.0 if s < 150 else 100.0, "b.weight": lambda s: 0.5 if s < 150 else 15.0}
    (f,) = _grown({**blown, "c.weight": lambda s: 1.0})
    assert (f["n"], f["tensors"], f["lr"]) == (2, 3, 1.0), f
    assert f["names"] == "a.weight grew 100x, b.weight grew 30x", f
    # one Adam step at a rate of 1 on weights of 0.2: 5x at once
    assert _grown({n: (lambda s: 1.0 if s < 150 else 5.0) for n in ("a.weight", "b.weight")})
    # quiet: weights that grew as far over more than 300 steps, or 5x over 250 (updates at the top of the healthy
    # range); that grew 3x only; whose size fell back (the rows before the growth alone); one tensor of three blown up
    slow = {n: (lambda s: 1.0 if s < 150 else 100.0) for n in ("a.weight", "b.weight")}
    assert not _grown(slow, steps=[120, 480, 540, 600, 660, 720])
    assert not _grown(
        {n: (lambda s: 1.0 if s < 150 else 5.0) for n in ("a.weight", "b.weight")}, [60, *range(310, 360, 10)]
    )
    assert not _grown({n: (lambda s: 1.0 if s < 150 else 3.0) for n in ("a.weight", "b.weight")})
    assert not _grown({n: (lambda s: 100.0 if s in (180, 240) else 1.0) for n in ("a.weight", "b.weight")})
    assert not _grown({"a.weight": blown["a.weight"], "b.weight": lambda s: 1.0, "c.weight": lambda s: 1.0})


def _scaler(rows, last=None):
    return rule_rows(
        "clip_before_unscale", {"torch.scaler": (SCALER, rows), "torch.steps": _steps(last or rows[-1][1])}
    )


def test_clip_before_unscale_needs_the_last_two_measured_steps_clipped_scaled():
    unscaled = [(None, s, 0.0, 65536.0, False, None) for s in range(1, 21)]
    (f,) = _scaler(unscaled + [(None, s, 0.0, 65536.0, True, 0.5) for s in range(21, 25)])
    assert (f["since"], f["step"], f["scale"], f["seen"]) == (21, 24, 65536.0, 32768.0), f
    assert not _scaler(unscaled)
    # the scaler gone (its rows stopped): no finding
    assert not _scaler(unscaled + [(None, s, 0.0, 65536.0, True, 0.5) for s in range(21, 25)], last=40)
    assert not _scaler(unscaled + [(None, 21, 0.0, 65536.0, True, 0.5)])
    assert not _scaler([(None, 1, 0.0, 65536.0, True, 0.5), (None, 2, 0.0, 65536.0, False, None)])


def _collapsed(rows, last=None):
    return rule_rows(
        "loss_scale_collapsed", {"torch.scaler": (SCALER, rows), "torch.steps": _steps(last or rows[-1][1])}
    )


def test_loss_scale_collapsed_needs_a_scale_below_one_still_falling():
    steady = [(None, s, 0.0, 65536.0, False, None) for s in range(1, 21)]
    # three of every four steps overflow: the scale halves three times per step applied
    falling = [(None, s, 0.0, 2.0 ** (16 - 3 * (s - 20)), False, None) for s in range(21, 31)]
    (f,) = _collapsed(steady + falling)
    assert (f["since"], f["step"], f["applied"], f["halvings"]) == (26, 30, 4, 12), f
    (said,) = rule_rows(
        "loss_scale_collapsed",
        {"torch.scaler": (SCALER, steady + falling), "torch.steps": _steps(30)},
        messages=True,
    )
    assert said.startswith(
        "the loss scale has collapsed: the GradScaler's scale fell from 0.25 at step 26 to 6.1e-05 at step 30 "
        "(12 halvings over 4 optimizer steps applied: 12 or more steps were skipped)."
    ), said
    # down to 0: every step skipped from then on
    (f,) = _collapsed(steady + falling + [(None, 31, 0.0, 0.0, False, None)])
    assert f["halvings"] is None and f["skipped"] == "down to 0, where every step is skipped", f
    # quiet: a healthy scale; a scale that fell but stays above 1 or settled below it; rows that stopped
    assert not _collapsed(steady)
    assert not _collapsed(steady + falling[:3])  # 8192 to 256: still a working scale
    assert not _collapsed(steady + falling + [(None, s, 0.0, falling[-1][3], False, None) for s in range(31, 36)])
    assert not _collapsed(steady + falling, last=50)


LOADERS = "rank INTEGER, name VARCHAR, sampler VARCHAR, shuffle BOOLEAN, sampler_epoch BIGINT"


def _epochs(loaders, rows):
    return rule_rows("sampler_epoch_unset", {"torch.dataloaders": (LOADERS, loaders), "torch.batches": (BATCHES, rows)})


def test_sampler_epoch_unset_needs_a_shuffling_distributed_sampler_at_epoch_0_and_batches_that_came_back():
    # given: an epoch of 10 batches, measured at every third step: from step 11 on, each batch is one seen 10 before
    rows = [(None, s, 0.0, f"b{s % 10}", f"t{s % 10}", 32.0, 10.0, 1.0, 0.2) for s in range(1, 60, 3)]
    unset = [(None, "loader", "DistributedSampler", True, 0)]
    (f,) = _epochs(unset, rows)
    assert (f["name"], f["step"], f["repeated"], f["apart"]) == ("loader", 58, 10, 30), f
    # quiet: set_epoch called (epoch 5); a sampler that does not shuffle; a RandomSampler (a new order every epoch:
    # no batch comes back); the first epoch alone; one batch again and again (same_batch's)
    assert not _epochs([(None, "loader", "DistributedSampler", True, 5)], rows)
    assert not _epochs([(None, "loader", "DistributedSampler", False, 0)], rows)
    assert not _epochs([(None, "loader", "RandomSampler", True, None)], rows)
    assert not _epochs(unset, [r for r in rows if r[1] <= 10])
    assert not _epochs(unset, [(None, s, 0.0, "one", "t", 32.0, 10.0, 1.0, 0.2) for s in range(1, 60)])
