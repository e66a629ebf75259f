"""The doctor's rules over hand-made rows, its rule registry and its message templates: no process is
started (the rules as real jobs trip them are in tests/doctor/test_doctor.py and the planted-fault tests)."""

from __future__ import annotations

import pytest

from _doctor import rule_rows
from harness import ROOT


def _run_rule(name: str, parameters: list, step: int = 100) -> list:
    """Rule ``name``'s SQL over hand-made torch.parameters rows (name, numel, grad_norm[, requires_grad[,
    in_optimizer]])."""
    return rule_rows(
        name,
        {
            "torch.parameters": (
                "rank INTEGER, model VARCHAR, name VARCHAR, numel BIGINT, grad_norm DOUBLE, requires_grad BOOLEAN, "
                "in_optimizer BOOLEAN",
                [(None, "model", n, k, g, *(list(rest) + [True, True])[:2]) for n, k, g, *rest in parameters],
            ),
            "torch.steps": f"SELECT NULL::INTEGER AS rank, range AS step FROM range(1, {step + 1})",
        },
    )


def _stack(prefix: str, rms: list) -> list:
    """A numbered stack: layer i has a [32, 32] weight and a [32] bias whose gradients have RMS ``rms[i]``."""
    return [(f"{prefix}{i}.{p}", k, r * k**0.5) for i, r in enumerate(rms) for p, k in (("weight", 1024), ("bias", 32))]


def test_grads_by_layer_compares_the_first_and_last_numbered_layer_either_way():
    # vanishing: the first layer's gradient per element is 1e-5 of the last's, named with both layers
    (f,) = _run_rule("grads_by_layer", _stack("", [1e-7, 1e-5, 1e-3, 1e-2]))
    assert (f["direction"], f["first_layer"], f["last_layer"], f["layers"], f["stack_name"]) == (
        "vanish",
        "0",
        "3",
        4,
        "model",
    )
    assert abs(f["ratio"] - 1e-5) < 1e-9, f
    # exploding, in a ModuleList inside the model, with sub-modules numbered too (blocks.2.mlp.0.weight is block 2)
    rows = _stack("blocks.", [50.0, 1.0, 0.01]) + [("blocks.2.mlp.0.weight", 64, 0.001), ("head.weight", 256, 1.0)]
    (f,) = _run_rule("grads_by_layer", rows)
    assert (f["direction"], f["first_layer"], f["last_layer"], f["stack_name"]) == (
        "explode",
        "blocks.0",
        "blocks.2",
        "model.blocks",
    )
    assert f["ratio"] > 1e3, f
    # quiet: a spread of 100x; two layers only; names with digits that are no layer number (conv1, conv2, conv3);
    # an exact 0 (dead units: another rule's); before step 50; frozen first layers left out
    assert not _run_rule("grads_by_layer", _stack("", [0.01, 0.1, 1.0]))
    assert not _run_rule("grads_by_layer", _stack("", [1e-7, 1.0]))
    assert not _run_rule("grads_by_layer", [(f"conv{i}.weight", 9, r) for i, r in ((1, 1e-9), (2, 1.0), (3, 1.0))])
    assert not _run_rule("grads_by_layer", _stack("", [0.0, 1e-3, 1.0]))
    assert not _run_rule("grads_by_layer", _stack("", [1e-7, 1e-5, 1e-3, 1e-2]), step=40)
    assert not _run_rule(
        "grads_by_layer", [("0.weight", 1024, None, False)] + [(f"{i}.weight", 1024, 32.0) for i in (1, 2, 3)]
    )
    # a first layer no optimizer steps (grads_not_optimized's finding) is not the stack's gradient problem
    assert not _run_rule(
        "grads_by_layer", [("0.weight", 1024, 5e3, True, False)] + [(f"{i}.weight", 1024, 4.0) for i in (1, 2, 3)]
    )


def test_a_rule_of_an_unknown_family_is_refused_in_one_sentence():
    from probe.diagnosis.rules import FAMILIES, get_rule, rule

    with pytest.raises(ValueError) as caught:
        rule(
            "misfiled",
            family="gradients",
            severity="warning",
            description="Never registered.",
            sql="SELECT 1",
            message="never.",
        )
    assert str(caught.value) == f"rule misfiled: family must be one of {', '.join(FAMILIES)}, not 'gradients'"
    assert get_rule("misfiled") is None


def test_every_rule_is_documented_with_an_example():
    from probe.cli.doctor import all_rules

    doc = (ROOT / "docs" / "doctor.md").read_text()
    for r in all_rules():
        assert f"| `{r.name}` |" in doc, f"docs/doctor.md does not list rule {r.name}"


def test_a_message_field_that_does_not_fit_its_format_costs_that_field_only():
    """A NULL or text value where a rule's template says ``{x:.2f}`` prints '?' or the text, never a traceback."""
    from probe.cli import doctor as diagnose  # (its docstring examples run in tests/unit/test_doctests.py)

    # given a template with numeric specs and a row whose values are NULL, text and numbers
    msg = diagnose.fill_message("{a:.2f} then {b:.1%} on {c} ({d:>4d})", {"a": None, "b": "n/a", "c": 3, "d": 7})
    # then each field fails or succeeds alone
    assert msg == "? then n/a on 3 (   7)"


def _memory_rows(rows: list) -> list:
    """allocator_fragmentation's SQL over hand-made torch.memory rows (device, allocated, reserved, retries, ooms,
    total in GiB); CUDA allocators cannot be made to fragment on this CPU-only host."""
    g = 2**30

    def gib(v):
        return None if v is None else int(v * g)

    return rule_rows(
        "allocator_fragmentation",
        {
            "torch.memory": (
                "rank INTEGER, device VARCHAR, allocated BIGINT, reserved BIGINT, alloc_retries BIGINT, ooms BIGINT, "
                "total BIGINT, rss BIGINT",
                [(None, d, gib(a), gib(r), n, o, gib(t), None) for d, a, r, n, o, t in rows],
            )
        },
    )


def test_allocator_fragmentation_needs_retries_and_a_large_unused_reservation():
    from probe.cli.doctor import fill_message as _fill
    from probe.cli.doctor import get_rule

    # fragmented: 30 of 70 GiB reserved hold no tensor, and 12 allocations had to flush the cache and retry
    (f,) = _memory_rows([("cuda:0", 40, 70, 12, 0, 80), ("cpu", None, None, None, None, None)])
    assert (f["device"], f["cached_gb"], f["retries"]) == ("cuda:0", 30.0, 12)
    said = _fill(get_rule("allocator_fragmentation").message, f)
    assert (
        said.startswith("cuda:0: the caching allocator reserves 70.0 GiB of 80.0 but tensors hold only 40.0 GiB")
        and "expandable_segments:True" in said
    ), said
    # an OOM with the cache in pieces counts too
    assert _memory_rows([("cuda:1", 10, 20, 0, 1, 24)])
    # quiet: a big cache without retries (the allocator keeping memory is normal), retries with a full reservation
    # (the job simply needs the memory: not fragmentation), a small device's 0.5 GiB slack, and the CPU row
    assert not _memory_rows([("cuda:0", 10, 60, 0, 0, 80)])
    assert not _memory_rows([("cuda:0", 68, 70, 40, 0, 80)])
    assert not _memory_rows([("cuda:0", 1.5, 2.0, 3, 0, 4)])
    assert not _memory_rows([("cpu", None, None, None, None, None)])


def _input_bound(loaders: list, main_stack: list, step_ms: float = 50.0, model_ms: float = 1.0) -> list:
    """input_bound's SQL over 10 hand-made traced steps of ``step_ms`` (``model_ms`` in the root model),
    torch.dataloaders rows (name, dataset_type, batch_size, num_workers) and the main thread's stack (func, file),
    innermost first."""
    return rule_rows(
        "input_bound",
        {
            "torch.steps": (
                f"SELECT NULL::INTEGER AS rank, range AS step, {step_ms / 1000} AS duration, "
                "NULL::DOUBLE AS comm_wait, "
                "NULL::DOUBLE AS cpu_wait, NULL::DOUBLE AS data_wait FROM range(1, 11)"
            ),
            "python.torch_trace": (
                f"SELECT NULL::INTEGER AS rank, range AS step, 0 AS depth, {model_ms / 1000} AS duration FROM "
                "range(1, 11)"
            ),
            "torch.dataloaders": (
                "rank INTEGER, name VARCHAR, dataset_type VARCHAR, batch_size BIGINT, num_workers INTEGER",
                [(None, *row) for row in loaders],
            ),
            "python.backtrace": (
                "rank INTEGER, is_main BOOLEAN, depth INTEGER, func VARCHAR, file VARCHAR, lineno INTEGER",
                [(None, True, d, f, path, 10) for d, (f, path) in enumerate(main_stack)],
            ),
        },
    )


def _paired_workers(fast_ms: float, slow_ms: float, model_ms: float = 1.0, traced_every: int = 10) -> list:
    """input_bound over 200 steps whose batches come in pairs (two DataLoader workers): even steps wait
    ``fast_ms`` for data, odd ones ``slow_ms``; the model takes ``model_ms``; every ``traced_every``-th step
    (an even one: the aliasing the jitter prevents) is traced."""
    return rule_rows(
        "input_bound",
        {
            "torch.steps": (
                f"SELECT NULL::INTEGER AS rank, range AS step, "
                f"(CASE WHEN range % 2 = 0 THEN {fast_ms} ELSE {slow_ms} END + {model_ms}) / 1000 AS duration, "
                f"NULL::DOUBLE AS comm_wait, NULL::DOUBLE AS cpu_wait, "
                f"CASE WHEN range % 2 = 0 THEN {fast_ms} ELSE {slow_ms} END / 1000 AS data_wait FROM range(1, 201)"
            ),
            "python.torch_trace": (
                f"SELECT NULL::INTEGER AS rank, range AS step, 0 AS depth, {model_ms / 1000} AS duration "
                f"FROM range({traced_every}, 201, {traced_every})"
            ),
            "torch.dataloaders": (
                "rank INTEGER, name VARCHAR, dataset_type VARCHAR, batch_size BIGINT, num_workers INTEGER",
                [(None, "loader", "Slow", 16, 2)],
            ),
            "python.backtrace": (
                "rank INTEGER, is_main BOOLEAN, depth INTEGER, func VARCHAR, file VARCHAR, lineno INTEGER",
                [],
            ),
        },
    )


def test_input_bound_judges_every_step_so_paired_workers_cannot_hide_the_slow_half():
    # given: batches in pairs, 0.5 ms then 166 ms of waiting, and only even steps traced
    (f,) = _paired_workers(0.5, 166.0)
    # then: every step's data_wait counts, the slow half included: ~84 ms a step, ~1 ms in the model
    assert 80 < f["step_ms"] < 86 and 0.5 < f["model_ms"] < 1.5 and f["outside_pct"] > 95, f
    assert f["steps"] == 50, f
    # and a healthy loader (2 ms of waiting around a 10 ms model) is not named
    assert not _paired_workers(1.0, 3.0, model_ms=10.0)


def test_input_bound_names_loaders_without_workers_and_where_the_main_thread_loads():
    from probe.cli.doctor import fill_message as _fill
    from probe.cli.doctor import get_rule

    data = "/venv/site-packages/torch/utils/data"
    loading = [
        ("__getitem__", "/job/data.py"),
        ("<listcomp>", f"{data}/_utils/fetch.py"),
        ("fetch", f"{data}/_utils/fetch.py"),
        ("__next__", f"{data}/dataloader.py"),
        ("<module>", "/job/train.py"),
    ]
    # given: a job spending 98% of its steps outside the model, one loader with no workers, the main thread in its
    # dataset
    (f,) = _input_bound([("train_loader", "Shards", 32, 0), ("val_loader", "Shards", 64, 4)], loading)
    said = _fill(get_rule("input_bound").message, f)
    # then: the loader without workers is named (not the one with workers), and the innermost loading frame
    assert "; DataLoader train_loader (Shards, batch_size 32) has num_workers=0: the training thread loads" in said, (
        said
    )
    assert "val_loader" not in said and said.endswith("; the main thread is in __getitem__ (data.py:10) now."), said
    # several loaders without workers; the main thread in the DataLoader itself (an IterableDataset has no __getitem__)
    (f,) = _input_bound([("a", "Stream", None, 0), ("b", "Shards", 8, 0)], loading[3:])
    said = _fill(get_rule("input_bound").message, f)
    assert "DataLoaders a (Stream, batch_size none), b (Shards, batch_size 8) have num_workers=0" in said, said
    assert said.endswith("; the main thread is in __next__ (dataloader.py:10) now."), said
    # no evidence at hand: the share alone, as before
    (f,) = _input_bound([("train_loader", "Shards", 32, 4)], [("step", "/venv/site-packages/torch/optim/sgd.py")])
    assert _fill(get_rule("input_bound").message, f).endswith(
        "the input pipeline or host-side work is the bottleneck."
    ), f
    # quiet: a loader with no workers and the main thread in it, when the model takes most of the step
    assert not _input_bound([("train_loader", "Shards", 32, 0)], loading, step_ms=50.0, model_ms=40.0)


def _starved(step_ms: float, data_ms: float, wait_ms: float) -> list:
    """input_bound over 60 steps of ``step_ms``, ``data_ms`` of them before the first forward call, ``wait_ms``
    of them waiting for a CPU (measured on every step)."""
    return rule_rows(
        "input_bound",
        {
            "torch.steps": (
                f"SELECT NULL::INTEGER AS rank, range AS step, {step_ms / 1000} AS duration, "
                f"NULL::DOUBLE AS comm_wait, {wait_ms / 1000} AS cpu_wait, {data_ms / 1000} AS data_wait "
                "FROM range(1, 61)"
            ),
            "python.torch_trace": "SELECT NULL::INTEGER AS rank, 1 AS step, 0 AS depth, 0.001 AS duration",
            "torch.dataloaders": (
                "rank INTEGER, name VARCHAR, dataset_type VARCHAR, batch_size BIGINT, num_workers INTEGER",
                [],
            ),
            "python.backtrace": (
                "rank INTEGER, is_main BOOLEAN, depth INTEGER, func VARCHAR, file VARCHAR, lineno INTEGER",
                [],
            ),
        },
        messages=True,
    )


def test_input_bound_on_a_starved_host_says_both():
    # given: 197 ms steps, 180 ms of them before the forward call, 79% of the step waiting for a CPU: the wait falls
    # on the loading as on the model, so taking it out of the loading alone left the model most of the step
    (said,) = _starved(197.0, 180.0, 156.0)
    # then: input bound, and starved too
    assert said.startswith("91% of step time is spent outside forward/backward (197.0 ms a step, 17.0 ms"), said
    assert "the host is starved too: the training thread waited 156.0 ms a step for a CPU (79% of the step)" in said
    # and: a healthy job on a loaded host, its time outside the model mostly waiting for a CPU, is not input bound
    assert not _starved(30.0, 22.0, 18.0)
    # nor is an input-bound job on a quiet host said to be starved
    (said,) = _starved(60.0, 55.0, 1.0)
    assert "starved" not in said, said
