"""`probe doctor` on NaNs, hangs, a process stuck in C, a starved host and healthy jobs (nothing above info);
the catalog of planted faults runs in tests/doctor/test_doctor_faults_model.py and _runtime.py.

The jobs are tests/targets/faults.py started with PROBE=1 (no probe code in the script),
and a process stuck in C with the GIL held. The doctor is polled with a deadline until
the fault's rule shows (the fault needs some steps to leave its trace), never slept on.
"""

from __future__ import annotations

import json

import pytest

from conftest import EXAMPLES, TARGETS, poll, requires_torch
from harness import max_step
from _doctor import doctor, find, poll_for

# the rules a healthy job must leave quiet, each with a planted fault in fault_catalog.FAULTS
HEALTHY_QUIET = ("grads_by_layer", "grad_norm_zero", "loss_spike", "loss_diverging", "input_bound")


@requires_torch
def test_a_nan_loss_is_nan_in_sql_at_its_step_and_the_doctor_says_nothing_preceded_it(spawn, cli):
    # given: NaN inputs from step 40 on, and every 7th step's loss unknown to probe (no `loss`, explicit gradients)
    # (every step measured: the values of exact steps are checked here; tests/training/test_torch_budget.py covers
    # sampling)
    job = spawn(
        [
            TARGETS / "faults.py",
            "--fault",
            "nan_from_data",
            "--fault-step",
            "40",
            "--hide-loss-every",
            "7",
            "--settle",
            "5",
        ],
        env={"PROBE": "1", "PROBE_STEP_BUDGET": "off"},
        ready="planted",
        timeout=180,
    )
    # when
    r = cli(
        job.pid,
        "query",
        "SELECT step, loss, isnan(loss) AS nan FROM torch.steps WHERE step <= 44 ORDER BY step",
        "--format",
        "json",
    )
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
    r = cli(
        job.pid,
        "query",
        "SELECT step, severity, json_extract_string(evidence, '$.cause') AS cause FROM diagnosis.findings "
        "WHERE rule = 'loss_nonfinite'",
        "--format",
        "json",
    )
    (row,) = json.loads(r.stdout)
    assert row["step"] == 40 and row["severity"] == "critical" and row["cause"].startswith("with neither"), row


@requires_torch
def test_a_nan_loss_after_an_lr_jump_names_the_jump(spawn, cli):
    job = spawn(
        [TARGETS / "faults.py", "--fault", "nan_after_lr_jump", "--fault-step", "40", "--settle", "10"],
        env={"PROBE": "1", "PROBE_STEP_BUDGET": "off"},
        ready="planted",
        timeout=180,
    )  # exact steps checked
    finding, _ = find(cli, job.pid, "loss_nonfinite")
    assert 40 < finding["step"] <= 45, finding
    assert "the learning rate jumped 2e+05x (0.05 -> 1e+04) at step 40" in finding["message"], finding


@requires_torch
def test_frozen_model_is_also_at_chance_level(spawn, cli):
    # (every step measured: loss_at_chance reads the last 40 measured losses, which the default budget may take
    # seconds to gather on a loaded host; "planted" is then a state that has them)
    job = spawn(
        [TARGETS / "faults.py", "--fault", "frozen", "--settle", "60"],
        env={"PROBE": "1", "PROBE_STEP_BUDGET": "off"},
        ready="planted",
        timeout=180,
    )
    finding, _ = find(cli, job.pid, "loss_at_chance")
    assert "ln(8) = 2.079" in finding["message"], finding


@requires_torch
def test_loss_at_chance_takes_the_class_count_from_the_losss_logits(spawn, cli):
    # given: a tiny GPT-2 (vocabulary 128; c_attn 96 wide, the embedding 32) whose loss sits at ln(128)
    job = spawn([TARGETS / "gpt2_chance.py"], env={"PROBE": "1"}, timeout=180)
    # then: the loss's own logits give the class count, not a parameter's width
    r = cli(job.pid, "query", "SELECT function, classes, logits_shape FROM torch.loss", "--format", "json")
    assert json.loads(r.stdout) == [{"function": "NllLossBackward0", "classes": 128, "logits_shape": "[64, 128]"}], (
        r.stdout
    )
    finding, _ = poll_for(cli, job.pid, "loss_at_chance")
    assert "ln(128) = 4.852, chance level for 128 classes" in finding["message"], finding


@requires_torch
def test_hung_training_loop_says_where(spawn, cli):
    job = spawn(
        [TARGETS / "faults.py", "--fault", "hang"],
        env={"PROBE": "1", "PROBE_HUNG_AFTER": "1"},
        ready="planted",
        timeout=120,
    )
    finding, _ = poll_for(cli, job.pid, "hung", env={"PROBE_HUNG_AFTER": "1"})
    assert finding["severity"] == "critical"
    assert "faults.py" in finding["message"] and "no step has completed" in finding["message"]
    assert "the other threads: prefetch in wait_for_shard (" in finding["message"], (
        finding
    )  # every thread, not only main


@requires_torch
def test_a_stall_is_judged_against_the_jobs_own_pace_before_hung_after(spawn, cli):
    # given: a job of ~5 ms steps whose main thread stops (PROBE_HUNG_AFTER left at its 60 s default)
    job = spawn(
        [TARGETS / "faults.py", "--fault", "hang", "--fault-step", "60"],
        env={"PROBE": "1"},
        ready="planted",
        timeout=120,
    )
    # when: the doctor looks while it is still well under a minute
    finding, findings = poll_for(cli, job.pid, "stalled", timeout=50)
    # then: a stall against its own step times, where the main thread is; not yet hung
    assert finding["severity"] == "warning"
    assert "this job's own p99 step time" in finding["message"] and "faults.py" in finding["message"], finding
    assert finding["evidence"]["idle_s"] > 10 and finding["evidence"]["ratio"] > 50, finding
    assert not [f for f in findings if f["rule"] == "hung"], findings


def _status_and_listed(cli, pid) -> tuple[dict, dict]:
    """``probe PID status``'s row and ``probe list``'s row of ``pid``."""
    status = cli(pid, "--format", "json", "status")
    assert status.returncode == 0, status.stderr
    listed = cli("list", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(status.stdout)
    return row, next(r for r in json.loads(listed.stdout) if r["pid"] == pid)


@requires_torch
def test_status_list_and_the_doctor_tell_one_story_of_a_stall(spawn, cli, tmp_path):
    # given: a loop of ~20 ms steps that, once told, sleeps 90 s between two steps (its main thread asleep throughout)
    stall = tmp_path / "stall"
    job = spawn(
        [TARGETS / "actions_train.py", "--sched", "none", "--stall-file", stall, "--stall-for", "90"],
        env={"PROBE_HUNG_AFTER": "600"},
    )
    job.wait_for("step 30 lr")  # enough steps for its pace
    # then, while it trains: every view says training
    row, listed = _status_and_listed(cli, job.pid)
    assert row["state"] == listed["state"] == "training", (row, listed)
    # when: it stalls
    stall.touch()
    job.wait_for("stalled at step")

    # then: once status calls it stalled (its own pace: 50x its p99 step time, 10 s at least), list says the same with
    # the same reason, and the doctor too, while the stall lasts
    def stalled():
        row, listed = _status_and_listed(cli, job.pid)
        return (row, listed) if row["state"] == "stalled" else None

    found = poll(stalled, 60, interval=1.0)
    assert found, "status never called the stall stalled"
    row, listed = found
    # (the same words; the seconds go on between the two answers)
    for said in (row["reason"], listed["reason"]):
        assert said.startswith("no step for ") and "x the job's p99 step time of " in said, (row, listed)
    assert listed["state"] == "stalled", listed
    finding, findings = find(cli, job.pid, "stalled")
    assert "it has stalled" in finding["message"], finding
    assert not [f for f in findings if f["rule"] == "hung"], findings
    assert not any("resumed at step" in line for line in job.lines), "the stall ended before every view was asked"


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


def _waited_steps(cli, pid, since: int) -> int:
    sql = f"SELECT count(*) AS n FROM torch.steps WHERE step > {since} AND cpu_wait IS NOT NULL"
    return json.loads(cli(pid, "query", sql, "--format", "json").stdout)[0]["n"]


@requires_torch
def test_a_job_sharing_its_cpu_is_starved_not_regressed(spawn, cli):
    """A CPU hog on the job's own core doubles its step time: the doctor says the host is
    oversubscribed (cpu_starved, info) and does not call it the job's regression."""
    import os
    import subprocess
    import sys

    # every step measured (PROBE_STEP_BUDGET=off): each carries its CPU wait, so the steps the rule reads come at the
    # job's pace, not at the budget's, and the hog below spins for as short a time as the job needs
    job = spawn(
        [EXAMPLES / "train_gpt.py", "--print-every", "50"],
        env={"PROBE": "1", "PROBE_STEP_BUDGET": "off"},
        ready="step 100",
        timeout=180,
    )
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(job.pid, {cpu})
    start = max_step(cli, job.pid)
    # in a session of its own, as the job is: with autogroup scheduling each session is a group with an equal share of
    # the core, and a hog left in pytest's group (whose load is mostly on the other core) got well under half of it
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        # when: the job shares the core with the hog until most of the last 50 steps the rule reads waited for it
        assert poll(lambda: _waited_steps(cli, job.pid, start + 10) >= 30, 240, interval=1.0)
        doc = doctor(cli, job.pid)
        rows = json.loads(
            cli(
                job.pid,
                "query",
                f"SELECT median(duration) AS d, median(cpu_wait) AS w FROM torch.steps "
                f"WHERE step > {start + 10} AND cpu_wait IS NOT NULL",
                "--format",
                "json",
            ).stdout
        )
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
    job = spawn(
        [TARGETS / "faults.py", "--fault", "healthy", "--ready-step", "150"],
        env={"PROBE": "1", "PROBE_TRACE": "5"},
        timeout=180,
    )
    # when
    doc = doctor(cli, job.pid, "--all")
    # then: the statistics are there, and none of the rules that read them speaks; nor the loss and gradient
    # rules (a loss near 1e-6 that wobbles, three layers of gradients), nor input_bound (5 ms of host-side sleep a step)
    assert not [f for f in doc["findings"] if f["rule"] in ("dead_activations", "collapsed_output", "host_syncs")], doc
    assert not [f for f in doc["findings"] if f["rule"] in HEALTHY_QUIET], doc
    assert not [s for s in doc["rules_skipped"] if s["rule"] in HEALTHY_QUIET], doc
    r = cli(
        job.pid,
        "query",
        "SELECT count(*) AS n FROM python.torch_trace WHERE module = '1' AND out_zero_frac BETWEEN 0.3 AND 0.7",
        "-f",
        "json",
    )
    assert json.loads(r.stdout)[0]["n"] >= 20


@requires_torch
def test_healthy_transformer_has_layer_gradients_within_a_few_x(spawn, cli):
    """The healthy control of grads_by_layer on a transformer: 4 pre-LN blocks (examples/train_gpt.py),
    past step 50 so the rule runs; their per-element gradients stay within 100x of each other."""
    # given
    job = spawn(
        [EXAMPLES / "train_gpt.py", "--layers", "4", "--print-every", "25"],
        env={"PROBE": "1"},
        ready="step 75",
        timeout=180,
    )
    # when
    doc = doctor(cli, job.pid, "--all")
    r = cli(
        job.pid,
        "query",
        "WITH l AS (SELECT CAST(regexp_extract(name, '^blocks[.](\\d+)[.]', 1) AS INTEGER) AS layer, "
        "sqrt(sum(grad_norm * grad_norm) / sum(numel)) AS rms FROM torch.parameters WHERE name LIKE 'blocks.%' "
        "AND grad_norm IS NOT NULL GROUP BY layer) "
        "SELECT count(*) AS layers, arg_min(rms, layer) / arg_max(rms, layer) AS ratio "
        "FROM l",
        "-f",
        "json",
    )
    # then: the rule ran, and found nothing to say
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["layers"] == 4 and 1e-2 < row["ratio"] < 1e2, row
    assert not [f for f in doc["findings"] if f["rule"] in HEALTHY_QUIET], doc
    assert not [s for s in doc["rules_skipped"] if s["rule"] == "grads_by_layer"], doc


def test_user_rule_declared_in_the_script_runs_too(spawn, cli):
    job = spawn(TARGETS / "idle.py", env={"IDLE_USER_RULE": "1"})
    doc = doctor(cli, job.pid)
    mine = [f for f in doc["findings"] if f["rule"] == "too_many_threads"]
    assert mine and "threads" in mine[0]["message"], doc
    # diagnosis.rules lists the script's own rule beside the ones probe ships (which the client holds)
    r = cli(job.pid, "query", "SELECT name, rank FROM diagnosis.rules", "--format", "json")
    assert r.returncode == 0, r.stderr
    names = {row["name"] for row in json.loads(r.stdout)}
    assert {"too_many_threads", "lr_zero", "hung"} <= names, names


@requires_torch
def test_the_training_process_loads_no_builtin_rule_and_no_record_reader(spawn, cli):
    """The rules probe ships and the post-mortem reading are the client's: a doctor run and a query leave them
    out of the training process, which keeps only the rule registry for its script's own rules."""
    # given: a job that trains, answered a query and a doctor run
    job = spawn([TARGETS / "actions_train.py"], ready="ready", timeout=120)
    assert max_step(cli, job.pid) >= 1
    doc = doctor(cli, job.pid)
    assert doc["rules_run"] >= 10, doc
    # when: it lists its own modules
    r = cli(job.pid, "eval", "import sys\nprint(' '.join(sorted(m for m in sys.modules if m.startswith('probe'))))")
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    # then: it runs probe (its agent and tables), but no module of the client, no built-in rule, no record reader
    assert {"probe.auto", "probe.diagnosis.rules", "probe.tables.diagnosis"} <= loaded, loaded
    assert not {m for m in loaded if m == "probe.cli" or m.startswith("probe.cli.")}, loaded
    assert {m for m in loaded if m.startswith("probe.diagnosis")} == {"probe.diagnosis", "probe.diagnosis.rules"}, (
        loaded
    )
    assert not {m for m in loaded if m.startswith("probe.postmortem.") and m.endswith(("reader", "listing"))}, loaded


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
        seen.append(max_step(shared_cli, healthy.pid))
        # 40+ steps on: the job prints every 50th step (after its boundary), so wait for its line, not with queries
        healthy.wait_for(f"step {(seen[-1] + 40 + 49) // 50 * 50} ", 60)
    assert shared_cli(healthy.pid, "doctor").returncode == 0


@requires_torch
def test_findings_are_a_table_listed_described_and_queryable(healthy, shared_cli):
    # listed and described like any table, with its column docs
    tables = json.loads(shared_cli(healthy.pid, "--format", "json", "tables").stdout)
    (t,) = [t for t in tables if t["name"] == "diagnosis.findings"]
    assert t["kind"] == "client" and [c["name"] for c in t["columns"]][:6] == [
        "rule",
        "family",
        "severity",
        "rank",
        "step",
        "message",
    ]
    described = shared_cli(healthy.pid, "describe", "diagnosis.findings")
    assert described.returncode == 0 and "JSON" in described.stdout, described.stderr
    # the guard takes it anywhere a table goes: joined with the rules, in a subquery
    r = shared_cli(
        healthy.pid,
        "query",
        "SELECT f.rule, f.severity, r.description FROM diagnosis.findings AS f "
        "JOIN diagnosis.rules AS r ON r.name = f.rule WHERE f.severity IN (SELECT 'critical' UNION SELECT 'warning')",
        "--format",
        "json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []  # a healthy job: nothing above info, in the table as in `doctor`
