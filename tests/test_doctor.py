"""`probe doctor` on NaNs, hangs, a process stuck in C, a starved host and healthy jobs (nothing above info);
the catalog of planted faults runs in tests/test_doctor_faults_model.py and _runtime.py.

The jobs are tests/targets/faults.py started with PROBE=1 (no probe code in the script),
and a process stuck in C with the GIL held. The doctor is polled with a deadline until
the fault's rule shows (the fault needs some steps to leave its trace), never slept on.
"""

from __future__ import annotations

import json

import pytest

from conftest import EXAMPLES, TARGETS, poll, requires_torch
from _doctor import doctor, find, poll_for, rule_rows

# the rules a healthy job must leave quiet, each with a planted fault in fault_catalog.FAULTS
HEALTHY_QUIET = ("grads_by_layer", "grad_norm_zero", "loss_spike", "loss_diverging", "input_bound")


@requires_torch
def test_a_nan_loss_is_nan_in_sql_at_its_step_and_the_doctor_says_nothing_preceded_it(spawn, cli):
    # given: NaN inputs from step 40 on, and every 7th step's loss unknown to probe (no `loss`, explicit gradients)
    # (every step measured: the values of exact steps are checked here; tests/test_torch_budget.py covers sampling)
    job = spawn([TARGETS / "faults.py", "--fault", "nan_from_data", "--fault-step", "40", "--hide-loss-every", "7",
                 "--settle", "5"], env={"PROBE": "1", "PROBE_STEP_BUDGET": "off"}, ready="planted", timeout=180)
    # when
    r = cli(job.pid, "query", "SELECT step, loss, isnan(loss) AS nan FROM torch.steps WHERE step <= 44 ORDER BY step",
            "--format", "json")
    # then: NaN from step 40, NULL (not NaN) on the steps whose loss was never read, finite before
    rows = {row["step"]: row for row in json.loads(r.stdout)}
    assert [s for s, row in rows.items() if row["nan"]] == [40, 41, 43, 44], rows
    assert all(rows[s]["loss"] is None and rows[s]["nan"] is None for s in (7, 14, 21, 28, 35, 42)), rows
    assert all(row["nan"] is False for s, row in rows.items() if s < 40 and s % 7), rows
    finding, findings = find(cli, job.pid, "loss_nonfinite")
    assert finding["step"] == 40 and "at step 40" in finding["message"] and "neither an LR jump" in finding["message"]
    # the onset as known: step 39 measured finite (every step is measured here); the loss stayed NaN since, so the
    # weights are NaN: restore a checkpoint, and no `lr --scale` or checkpoint of NaN weights among the next commands
    assert "first seen NaN/Inf at step 40 (step 39 was still finite)" in finding["message"], finding
    assert "restore the last checkpoint written before step 39" in finding["message"], finding
    assert not [n for n in finding["next"] if " lr --" in n or " checkpoint /" in n], finding["next"]
    assert any("nan_count + inf_count > 0" in n for n in finding["next"]), finding["next"]
    assert findings[0]["rule"] == "loss_nonfinite", findings  # the cause first, its consequences (NaN weights) after
    # the same finding as a row of diagnosis.findings, its evidence as JSON
    r = cli(job.pid, "query", "SELECT step, severity, json_extract_string(evidence, '$.cause') AS cause FROM diagnosis.findings "
            "WHERE rule = 'loss_nonfinite'", "--format", "json")
    (row,) = json.loads(r.stdout)
    assert row["step"] == 40 and row["severity"] == "critical" and row["cause"].startswith("with neither"), row


@requires_torch
def test_a_nan_loss_after_an_lr_jump_names_the_jump(spawn, cli):
    job = spawn([TARGETS / "faults.py", "--fault", "nan_after_lr_jump", "--fault-step", "40", "--settle", "10"],
                env={"PROBE": "1", "PROBE_STEP_BUDGET": "off"}, ready="planted", timeout=180)  # exact steps checked
    finding, _ = find(cli, job.pid, "loss_nonfinite")
    assert 40 < finding["step"] <= 45, finding
    assert "the learning rate jumped 2e+05x (0.05 -> 1e+04) at step 40" in finding["message"], finding


@requires_torch
def test_frozen_model_is_also_at_chance_level(spawn, cli):
    # (every step measured: loss_at_chance reads the last 40 measured losses, which the default budget may take
    # seconds to gather on a loaded host; "planted" is then a state that has them)
    job = spawn([TARGETS / "faults.py", "--fault", "frozen", "--settle", "60"], env={"PROBE": "1", "PROBE_STEP_BUDGET": "off"},
                ready="planted", timeout=180)
    finding, _ = find(cli, job.pid, "loss_at_chance")
    assert "ln(8) = 2.079" in finding["message"], finding


@requires_torch
def test_loss_at_chance_takes_the_class_count_from_the_losss_logits(spawn, cli):
    # given: a tiny GPT-2 (vocabulary 128; c_attn 96 wide, the embedding 32) whose loss sits at ln(128)
    job = spawn([TARGETS / "gpt2_chance.py"], env={"PROBE": "1"}, timeout=180)
    # then: the loss's own logits give the class count, not a parameter's width
    r = cli(job.pid, "query", "SELECT function, classes, logits_shape FROM torch.loss", "--format", "json")
    assert json.loads(r.stdout) == [{"function": "NllLossBackward0", "classes": 128, "logits_shape": "[64, 128]"}], r.stdout
    finding, _ = poll_for(cli, job.pid, "loss_at_chance")
    assert "ln(128) = 4.852, chance level for 128 classes" in finding["message"], finding


@requires_torch
def test_hung_training_loop_says_where(spawn, cli):
    job = spawn([TARGETS / "faults.py", "--fault", "hang"], env={"PROBE": "1", "PROBE_HUNG_AFTER": "1"},
                ready="planted", timeout=120)
    finding, _ = poll_for(cli, job.pid, "hung", env={"PROBE_HUNG_AFTER": "1"})
    assert finding["severity"] == "critical"
    assert "faults.py" in finding["message"] and "no step has completed" in finding["message"]
    assert "the other threads: prefetch in wait_for_shard (" in finding["message"], finding  # every thread, not only main


@requires_torch
def test_a_stall_is_judged_against_the_jobs_own_pace_before_hung_after(spawn, cli):
    # given: a job of ~5 ms steps whose main thread stops (PROBE_HUNG_AFTER left at its 60 s default)
    job = spawn([TARGETS / "faults.py", "--fault", "hang", "--fault-step", "60"], env={"PROBE": "1"},
                ready="planted", timeout=120)
    # when: the doctor looks while it is still well under a minute
    finding, findings = poll_for(cli, job.pid, "stalled", timeout=50)
    # then: a stall against its own step times, where the main thread is; not yet hung
    assert finding["severity"] == "warning"
    assert "this job's own p99 step time" in finding["message"] and "faults.py" in finding["message"], finding
    assert finding["evidence"]["idle_s"] > 10 and finding["evidence"]["ratio"] > 50, finding
    assert not [f for f in findings if f["rule"] == "hung"], findings


def test_process_stuck_in_c_with_the_gil_is_reported_from_outside(spawn, cli):
    # given: the server cannot answer (the GIL is held in a C call)
    job = spawn(TARGETS / "hang_gil.py", env={"TARGET_WITH_PROBE": "1"})
    # when
    doc = doctor(cli, job.pid, "--timeout", "2")
    # then: it says so, with what py-spy sees
    f = doc["findings"][0]
    assert f["rule"] == "not_answering" and f["severity"] == "critical"
    assert "not answering" in f["message"] and "stuck_in_c" in f["message"] and "GIL" in f["message"]
    assert doc["answering"] == 0


def _step(cli, pid) -> int:
    r = cli(pid, "query", "SELECT max(step) AS step FROM torch.steps", "--format", "json")
    return json.loads(r.stdout)[0]["step"]


@requires_torch
def test_a_job_sharing_its_cpu_is_starved_not_regressed(spawn, cli):
    """A CPU hog on the job's own core doubles its step time: the doctor says the host is
    oversubscribed (cpu_starved, info) and does not call it the job's regression."""
    import os
    import subprocess
    import sys

    job = spawn([EXAMPLES / "train_gpt.py", "--print-every", "50"], env={"PROBE": "1"}, ready="step 100", timeout=180)
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(job.pid, {cpu})
    start = _step(cli, job.pid)
    # in a session of its own, as the job is: with autogroup scheduling each session is a group with an equal share of
    # the core, and a hog left in pytest's group (whose load is mostly on the other core) got well under half of it
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        # when: 60 steps share the core with the hog
        assert poll(lambda: _step(cli, job.pid) >= start + 60, 120)
        doc = doctor(cli, job.pid)
        rows = json.loads(cli(job.pid, "query", f"SELECT median(duration) AS d, median(cpu_wait) AS w FROM torch.steps "
                              f"WHERE step > {start + 10} AND cpu_wait IS NOT NULL", "--format", "json").stdout)
    finally:
        hog.kill()
        hog.wait()
    # then: the steps waited for the CPU, and that is what the doctor says
    assert rows[0]["w"] > 0.25 * rows[0]["d"], rows
    rules = {f["rule"]: f for f in doc["findings"]}
    assert "throughput_regression" not in rules, doc["findings"]
    assert "cpu_starved" in rules and rules["cpu_starved"]["severity"] == "info", doc["findings"]
    assert "waited" in rules["cpu_starved"]["message"] and "share its cores" in rules["cpu_starved"]["message"]


@requires_torch
def test_healthy_relu_net_traced_often_has_no_activation_or_sync_finding(spawn, cli):
    # given: the healthy classifier (two ReLU layers, about half of their outputs 0), 30 traced steps
    job = spawn([TARGETS / "faults.py", "--fault", "healthy", "--ready-step", "150"], env={"PROBE": "1", "PROBE_TRACE": "5"},
                timeout=180)
    # when
    doc = doctor(cli, job.pid, "--all")
    # then: the statistics are there, and none of the rules that read them speaks; nor the loss and gradient
    # rules (a loss near 1e-6 that wobbles, three layers of gradients), nor input_bound (5 ms of host-side sleep a step)
    assert not [f for f in doc["findings"] if f["rule"] in ("dead_activations", "collapsed_output", "host_syncs")], doc
    assert not [f for f in doc["findings"] if f["rule"] in HEALTHY_QUIET], doc
    assert not [s for s in doc["rules_skipped"] if s["rule"] in HEALTHY_QUIET], doc
    r = cli(job.pid, "query", "SELECT count(*) AS n FROM python.torch_trace WHERE module = '1' AND out_zero_frac BETWEEN 0.3 AND 0.7",
            "-f", "json")
    assert json.loads(r.stdout)[0]["n"] >= 20


@requires_torch
def test_healthy_transformer_has_layer_gradients_within_a_few_x(spawn, cli):
    """The healthy control of grads_by_layer on a transformer: 4 pre-LN blocks (examples/train_gpt.py),
    past step 50 so the rule runs; their per-element gradients stay within 100x of each other."""
    # given
    job = spawn([EXAMPLES / "train_gpt.py", "--layers", "4", "--print-every", "25"], env={"PROBE": "1"}, ready="step 75",
                timeout=180)
    # when
    doc = doctor(cli, job.pid, "--all")
    r = cli(job.pid, "query", "WITH l AS (SELECT CAST(regexp_extract(name, '^blocks[.](\\d+)[.]', 1) AS INTEGER) AS layer, "
            "sqrt(sum(grad_norm * grad_norm) / sum(numel)) AS rms FROM torch.parameters WHERE name LIKE 'blocks.%' "
            "AND grad_norm IS NOT NULL GROUP BY layer) SELECT count(*) AS layers, arg_min(rms, layer) / arg_max(rms, layer) AS ratio "
            "FROM l", "-f", "json")
    # then: the rule ran, and found nothing to say
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["layers"] == 4 and 1e-2 < row["ratio"] < 1e2, row
    assert not [f for f in doc["findings"] if f["rule"] in HEALTHY_QUIET], doc
    assert not [s for s in doc["rules_skipped"] if s["rule"] == "grads_by_layer"], doc


def _run_rule(name: str, parameters: list, step: int = 100) -> list:
    """Rule ``name``'s SQL over hand-made torch.parameters rows (name, numel, grad_norm[, requires_grad[, in_optimizer]])."""
    return rule_rows(name, {
        "torch.parameters": ("rank INTEGER, model VARCHAR, name VARCHAR, numel BIGINT, grad_norm DOUBLE, requires_grad BOOLEAN, "
                             "in_optimizer BOOLEAN",
                             [(None, "model", n, k, g, *(list(rest) + [True, True])[:2]) for n, k, g, *rest in parameters]),
        "torch.steps": f"SELECT NULL::INTEGER AS rank, range AS step FROM range(1, {step + 1})"})


def _stack(prefix: str, rms: list) -> list:
    """A numbered stack: layer i has a [32, 32] weight and a [32] bias whose gradients have RMS ``rms[i]``."""
    return [(f"{prefix}{i}.{p}", k, r * k ** 0.5) for i, r in enumerate(rms) for p, k in (("weight", 1024), ("bias", 32))]


def test_grads_by_layer_compares_the_first_and_last_numbered_layer_either_way():
    # vanishing: the first layer's gradient per element is 1e-5 of the last's, named with both layers
    (f,) = _run_rule("grads_by_layer", _stack("", [1e-7, 1e-5, 1e-3, 1e-2]))
    assert (f["direction"], f["first_layer"], f["last_layer"], f["layers"], f["stack_name"]) == ("vanish", "0", "3", 4, "model")
    assert abs(f["ratio"] - 1e-5) < 1e-9, f
    # exploding, in a ModuleList inside the model, with sub-modules numbered too (blocks.2.mlp.0.weight is block 2)
    rows = _stack("blocks.", [50.0, 1.0, 0.01]) + [("blocks.2.mlp.0.weight", 64, 0.001), ("head.weight", 256, 1.0)]
    (f,) = _run_rule("grads_by_layer", rows)
    assert (f["direction"], f["first_layer"], f["last_layer"], f["stack_name"]) == ("explode", "blocks.0", "blocks.2", "model.blocks")
    assert f["ratio"] > 1e3, f
    # quiet: a spread of 100x; two layers only; names with digits that are no layer number (conv1, conv2, conv3);
    # an exact 0 (dead units: another rule's); before step 50; frozen first layers left out
    assert not _run_rule("grads_by_layer", _stack("", [0.01, 0.1, 1.0]))
    assert not _run_rule("grads_by_layer", _stack("", [1e-7, 1.0]))
    assert not _run_rule("grads_by_layer", [(f"conv{i}.weight", 9, r) for i, r in ((1, 1e-9), (2, 1.0), (3, 1.0))])
    assert not _run_rule("grads_by_layer", _stack("", [0.0, 1e-3, 1.0]))
    assert not _run_rule("grads_by_layer", _stack("", [1e-7, 1e-5, 1e-3, 1e-2]), step=40)
    assert not _run_rule("grads_by_layer", [("0.weight", 1024, None, False)] + [(f"{i}.weight", 1024, 32.0) for i in (1, 2, 3)])
    # a first layer no optimizer steps (grads_not_optimized's finding) is not the stack's gradient problem
    assert not _run_rule("grads_by_layer", [("0.weight", 1024, 5e3, True, False)] + [(f"{i}.weight", 1024, 4.0) for i in (1, 2, 3)])


def test_a_rule_of_an_unknown_family_is_refused_in_one_sentence():
    from probe.diagnosis.rules import FAMILIES, get_rule, rule

    with pytest.raises(ValueError) as caught:
        rule("misfiled", family="gradients", severity="warning", description="Never registered.", sql="SELECT 1",
             message="never.")
    assert str(caught.value) == f"rule misfiled: family must be one of {', '.join(FAMILIES)}, not 'gradients'"
    assert get_rule("misfiled") is None


def test_user_rule_declared_in_the_script_runs_too(spawn, cli):
    job = spawn(TARGETS / "idle.py", env={"IDLE_USER_RULE": "1"})
    doc = doctor(cli, job.pid)
    mine = [f for f in doc["findings"] if f["rule"] == "too_many_threads"]
    assert mine and "threads" in mine[0]["message"], doc
    assert cli(job.pid, "query", "SELECT name FROM diagnosis.rules WHERE name = 'too_many_threads'").returncode == 0


def test_every_rule_is_documented_with_an_example():
    from probe.diagnosis import builtin  # noqa: F401
    from probe.diagnosis.rules import all_rules

    from conftest import ROOT

    doc = (ROOT / "docs" / "doctor.md").read_text()
    for r in all_rules():
        assert f"| `{r.name}` |" in doc, f"docs/doctor.md does not list rule {r.name}"


def test_a_message_field_that_does_not_fit_its_format_costs_that_field_only():
    """A NULL or text value where a rule's template says ``{x:.2f}`` prints '?' or the text, never a traceback."""
    import doctest

    from probe.cli import diagnose

    failed, attempted = doctest.testmod(diagnose)
    assert attempted and not failed
    # given a template with numeric specs and a row whose values are NULL, text and numbers
    msg = diagnose.fill_message("{a:.2f} then {b:.1%} on {c} ({d:>4d})", {"a": None, "b": "n/a", "c": 3, "d": 7})
    # then each field fails or succeeds alone
    assert msg == "? then n/a on 3 (   7)"


def _memory_rows(rows: list) -> list:
    """allocator_fragmentation's SQL over hand-made torch.memory rows (device, allocated, reserved, retries, ooms,
    total in GiB); CUDA allocators cannot be made to fragment on this CPU-only host."""
    g = 2 ** 30
    gib = (lambda v: None if v is None else int(v * g))
    return rule_rows("allocator_fragmentation", {
        "torch.memory": ("rank INTEGER, device VARCHAR, allocated BIGINT, reserved BIGINT, alloc_retries BIGINT, ooms BIGINT, "
                         "total BIGINT, rss BIGINT",
                         [(None, d, gib(a), gib(r), n, o, gib(t), None) for d, a, r, n, o, t in rows])})


def test_allocator_fragmentation_needs_retries_and_a_large_unused_reservation():
    from probe.cli.diagnose import fill_message
    from probe.diagnosis.rules import get_rule

    # fragmented: 30 of 70 GiB reserved hold no tensor, and 12 allocations had to flush the cache and retry
    (f,) = _memory_rows([("cuda:0", 40, 70, 12, 0, 80), ("cpu", None, None, None, None, None)])
    assert (f["device"], f["cached_gb"], f["retries"]) == ("cuda:0", 30.0, 12)
    said = fill_message(get_rule("allocator_fragmentation").message, f)
    assert said.startswith("cuda:0: the caching allocator reserves 70.0 GiB of 80.0 but tensors hold only 40.0 GiB") and \
        "expandable_segments:True" in said, said
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
    return rule_rows("input_bound", {
        "torch.steps": (f"SELECT NULL::INTEGER AS rank, range AS step, {step_ms / 1000} AS duration, NULL::DOUBLE AS comm_wait, "
                        "NULL::DOUBLE AS cpu_wait, NULL::DOUBLE AS data_wait FROM range(1, 11)"),
        "python.torch_trace": f"SELECT NULL::INTEGER AS rank, range AS step, 0 AS depth, {model_ms / 1000} AS duration FROM range(1, 11)",
        "torch.dataloaders": ("rank INTEGER, name VARCHAR, dataset_type VARCHAR, batch_size BIGINT, num_workers INTEGER",
                              [(None, *row) for row in loaders]),
        "python.backtrace": ("rank INTEGER, is_main BOOLEAN, depth INTEGER, func VARCHAR, file VARCHAR, lineno INTEGER",
                             [(None, True, d, f, path, 10) for d, (f, path) in enumerate(main_stack)])})


def _paired_workers(fast_ms: float, slow_ms: float, model_ms: float = 1.0, traced_every: int = 10) -> list:
    """input_bound over 200 steps whose batches come in pairs (two DataLoader workers): even steps wait
    ``fast_ms`` for data, odd ones ``slow_ms``; the model takes ``model_ms``; every ``traced_every``-th step
    (an even one: the aliasing the jitter prevents) is traced."""
    return rule_rows("input_bound", {
        "torch.steps": (f"SELECT NULL::INTEGER AS rank, range AS step, "
                        f"(CASE WHEN range % 2 = 0 THEN {fast_ms} ELSE {slow_ms} END + {model_ms}) / 1000 AS duration, "
                        f"NULL::DOUBLE AS comm_wait, NULL::DOUBLE AS cpu_wait, "
                        f"CASE WHEN range % 2 = 0 THEN {fast_ms} ELSE {slow_ms} END / 1000 AS data_wait FROM range(1, 201)"),
        "python.torch_trace": (f"SELECT NULL::INTEGER AS rank, range AS step, 0 AS depth, {model_ms / 1000} AS duration "
                               f"FROM range({traced_every}, 201, {traced_every})"),
        "torch.dataloaders": ("rank INTEGER, name VARCHAR, dataset_type VARCHAR, batch_size BIGINT, num_workers INTEGER",
                              [(None, "loader", "Slow", 16, 2)]),
        "python.backtrace": ("rank INTEGER, is_main BOOLEAN, depth INTEGER, func VARCHAR, file VARCHAR, lineno INTEGER", [])})


def test_input_bound_judges_every_step_so_paired_workers_cannot_hide_the_slow_half():
    # given: batches in pairs, 0.5 ms then 166 ms of waiting, and only even steps traced
    (f,) = _paired_workers(0.5, 166.0)
    # then: every step's data_wait counts, the slow half included: ~84 ms a step, ~1 ms in the model
    assert 80 < f["step_ms"] < 86 and 0.5 < f["model_ms"] < 1.5 and f["outside_pct"] > 95, f
    assert f["steps"] == 50, f
    # and a healthy loader (2 ms of waiting around a 10 ms model) is not named
    assert not _paired_workers(1.0, 3.0, model_ms=10.0)


def test_input_bound_names_loaders_without_workers_and_where_the_main_thread_loads():
    from probe.cli.diagnose import fill_message
    from probe.diagnosis.rules import get_rule

    data = "/venv/site-packages/torch/utils/data"
    loading = [("__getitem__", "/job/data.py"), ("<listcomp>", f"{data}/_utils/fetch.py"), ("fetch", f"{data}/_utils/fetch.py"),
               ("__next__", f"{data}/dataloader.py"), ("<module>", "/job/train.py")]
    # given: a job spending 98% of its steps outside the model, one loader with no workers, the main thread in its dataset
    (f,) = _input_bound([("train_loader", "Shards", 32, 0), ("val_loader", "Shards", 64, 4)], loading)
    said = fill_message(get_rule("input_bound").message, f)
    # then: the loader without workers is named (not the one with workers), and the innermost loading frame
    assert "; DataLoader train_loader (Shards, batch_size 32) has num_workers=0: the training thread loads" in said, said
    assert "val_loader" not in said and said.endswith("; the main thread is in __getitem__ (data.py:10) now."), said
    # several loaders without workers; the main thread in the DataLoader itself (an IterableDataset has no __getitem__)
    (f,) = _input_bound([("a", "Stream", None, 0), ("b", "Shards", 8, 0)], loading[3:])
    said = fill_message(get_rule("input_bound").message, f)
    assert "DataLoaders a (Stream, batch_size none), b (Shards, batch_size 8) have num_workers=0" in said, said
    assert said.endswith("; the main thread is in __next__ (dataloader.py:10) now."), said
    # no evidence at hand: the share alone, as before
    (f,) = _input_bound([("train_loader", "Shards", 32, 4)], [("step", "/venv/site-packages/torch/optim/sgd.py")])
    assert fill_message(get_rule("input_bound").message, f).endswith("the input pipeline or host-side work is the bottleneck."), f
    # quiet: a loader with no workers and the main thread in it, when the model takes most of the step
    assert not _input_bound([("train_loader", "Shards", 32, 0)], loading, step_ms=50.0, model_ms=40.0)


@pytest.fixture(scope="module")
def healthy(shared_spawn):
    """The examples' training loop, healthy, shared by the tests that only read it. It trains flat out (a real job's
    step profile) until the module ends: its tests come last in the file, so that it does not take a core from the
    other tests' jobs and `probe` calls meanwhile."""
    return shared_spawn([EXAMPLES / "train_gpt.py", "--print-every", "50"], ready="step 150", timeout=180)


@requires_torch
def test_healthy_job_gets_nothing_above_info(healthy, shared_cli):
    # sampled while it trains (the full minute is benchmarks/bench_doctor.py): three doctor runs, 40+ steps apart
    seen = []
    for _ in range(3):
        doc = doctor(shared_cli, healthy.pid)
        loud = [f for f in doc["findings"] if f["severity"] != "info"]
        assert not loud, loud
        assert doc["rules_run"] >= 10, doc
        seen.append(_step(shared_cli, healthy.pid))
        # 40+ steps on: the job prints every 50th step (after its boundary), so wait for its line, not with queries
        healthy.wait_for(f"step {(seen[-1] + 40 + 49) // 50 * 50} ", 60)
    assert shared_cli(healthy.pid, "doctor").returncode == 0


@requires_torch
def test_findings_are_a_table_listed_described_and_queryable(healthy, shared_cli):
    # listed and described like any table, with its column docs
    tables = json.loads(shared_cli(healthy.pid, "--format", "json", "tables").stdout)
    (t,) = [t for t in tables if t["name"] == "diagnosis.findings"]
    assert t["kind"] == "client" and [c["name"] for c in t["columns"]][:6] == ["rule", "family", "severity", "rank", "step", "message"]
    described = shared_cli(healthy.pid, "describe", "diagnosis.findings")
    assert described.returncode == 0 and "JSON" in described.stdout, described.stderr
    # the guard takes it anywhere a table goes: joined with the rules, in a subquery
    r = shared_cli(healthy.pid, "query", "SELECT f.rule, f.severity, r.description FROM diagnosis.findings AS f "
                   "JOIN diagnosis.rules AS r ON r.name = f.rule WHERE f.severity IN (SELECT 'critical' UNION SELECT 'warning')",
                   "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []  # a healthy job: nothing above info, in the table as in `doctor`
