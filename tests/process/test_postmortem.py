"""Post-mortem records: a process that died still says how, and what its last steps were.

Real processes die for real: an exception in the loop, one in a worker thread, a native
crash (SIGSEGV), SIGKILL after some steps (only the periodic snapshot can speak for it),
and a normal exit. Each is then listed by `probe list --dead`, and its record is a
folder anyone can read without probe (JSON + numpy's .npz).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import sys
import time

import numpy as np
import pytest

from conftest import TARGETS, poll, requires_torch


def dead(cli, pid, timeout=60.0):
    """Poll `probe list --dead --json` until ``pid`` is there; its row."""
    listed = {}

    def row() -> list:
        r = cli("list", "--dead", "--json")
        assert r.returncode == 0, r.stderr
        listed["out"] = r.stdout
        return [row for row in json.loads(r.stdout) if row["pid"] == pid]

    rows = poll(row, timeout)
    assert rows, f"pid {pid} not listed as dead: {listed['out']}"
    return rows[0]


def steps_of(record: str) -> np.ndarray:
    with np.load(os.path.join(record, "tables.npz")) as z:
        assert "python.backtrace/func" in z.files and "process.info/pid" in z.files
        return z["torch.steps/step"]


@requires_torch
@pytest.mark.parametrize(
    "how, cause, words",
    [
        ("exception", "exception", ["RuntimeError: loss exploded at step 30", "dies.py"]),
        (
            "thread",
            "interrupted",
            ["KeyboardInterrupt", "thread data-prefetch died of RuntimeError: CUDA out of memory"],
        ),
        ("exit", "exit", ["exited normally"]),
        ("sysexit", "exit", ["exited with code 3 (sys.exit(3))"]),
    ],
)
def test_a_death_leaves_a_record(spawn, cli, probe_env, how, cause, words):
    # given / when: a job that dies (or, for a thread, loses a worker) at step 30
    shared = os.path.join(probe_env["PROBE_RUNTIME_DIR"], "registry")
    job = spawn(
        [TARGETS / "dies.py", "--how", how, "--steps", "30"],
        ready="ready",
        env={"PROBE_REGISTRY": shared} if how == "exit" else None,
    )
    if how == "thread":
        job.wait_for("CUDA out of memory")
        job.popen.send_signal(signal.SIGINT)  # then the job is stopped by hand: its record keeps the thread's death
    job.popen.wait(60)
    # then
    row = dead(cli, job.pid)
    assert row["cause"] == cause, row
    for w in words:
        assert w in row["what"], row
    assert row["last_step"] >= 30
    steps = steps_of(row["record"])
    assert steps.max() >= 30 and len(steps) >= 30
    meta = json.load(open(os.path.join(row["record"], "meta.json")))
    assert any(t["is_main"] for t in meta["stacks"])
    assert stat.S_IMODE(os.stat(row["record"]).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(row["record"], "tables.npz")).st_mode) == 0o600
    if how == "exit":  # with a shared registry, other nodes' CLIs find the record there too
        copy = os.path.join(shared, "postmortem", f"{socket.gethostname()}-{job.pid}")
        assert json.load(open(os.path.join(copy, "meta.json")))["cause"] == "exit"
        assert len(np.load(os.path.join(copy, "tables.npz"))["torch.steps/step"]) == len(steps)
        listed = json.loads(cli("list", "--dead", "--json", env={"PROBE_REGISTRY": shared}).stdout)
        assert [r["pid"] for r in listed].count(job.pid) == 1  # this host reads its own copy, not both
    if how == "exception":
        asked_dead_pid(cli, job.pid, "exception", "RuntimeError: loss exploded at step 30")
    if how in ("thread", "sysexit"):  # a deliberate end, but a worker thread died or the code says failure
        d = cli(str(job.pid), "--format", "json", "doctor")
        died = [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "rank_died"]
        assert d.returncode == 8 and died and words[-1] in died[0]["message"], d.stdout + d.stderr
    if how == "exit":  # a clean exit is no finding
        d = cli(str(job.pid), "--format", "json", "doctor")
        assert not [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "rank_died"], d.stdout


def asked_dead_pid(cli, pid: int, cause: str, words: str, frame: str | None = "<module>") -> None:
    """The read commands on a dead pid answer from its record: same tables, NULLs and types, source column."""
    q = cli(
        str(pid),
        "--format",
        "json",
        "query",
        "SELECT i.source, i.state, i.exit_cause, i.exit_reason, i.rank, max(s.step) AS last, count(*) AS steps, "
        "typeof(max(s.step)) AS t FROM process.info i, torch.steps s GROUP BY ALL",
    )
    assert q.returncode == 0, q.stderr
    (row,) = json.loads(q.stdout)
    assert row["source"] == "postmortem" and row["state"] == "dead" and row["exit_cause"] == cause, row
    assert words in row["exit_reason"] and row["rank"] is None and row["t"] == "BIGINT", row  # NULL, not NaN
    assert row["last"] >= 30 and row["steps"] >= 30, row
    bt = cli(str(pid), "backtrace")
    assert bt.returncode == 0 and "post-mortem record" in bt.stdout, bt.stdout + bt.stderr
    main = bt.stdout.split('"MainThread" (main)', 1)[1] if '"MainThread"' in bt.stdout else bt.stdout
    assert "dies.py" in main and (frame is None or f"#0   {frame} " in main), (
        bt.stdout
    )  # where it died, not probe's hook
    d = cli(str(pid), "--format", "json", "doctor")
    assert d.returncode == 8, d.stdout + d.stderr
    died = [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "rank_died"]
    assert died and died[0]["message"].startswith(f"pid {pid} died at step") and words in died[0]["message"], d.stdout
    assert not [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "hung"], d.stdout
    gone = cli(str(pid), "query", "SELECT count(*) FROM torch.parameters")
    assert gone.returncode != 0 and "Traceback" not in gone.stderr, gone.stderr
    assert "post-mortem record keeps" in gone.stderr and "not torch.parameters" in gone.stderr, gone.stderr


@requires_torch
def test_sigkill_leaves_the_last_periodic_snapshot(spawn, cli, probe_env):
    job = spawn([TARGETS / "dies.py", "--how", "wait", "--steps", "30"], env={"PROBE_POSTMORTEM_EVERY": "0.3"})
    record = os.path.join(probe_env["PROBE_RUNTIME_DIR"], "postmortem", str(job.pid))

    def snapshot_step():
        try:
            return steps_of(record).max() >= 30
        except (OSError, ValueError, KeyError, AssertionError):  # not yet written, or being replaced
            return False

    assert poll(snapshot_step, 60), "no periodic snapshot of step 30 was written"
    os.kill(job.pid, signal.SIGKILL)
    job.popen.wait(10)
    row = dead(cli, job.pid)
    assert row["cause"] == "killed" and "SIGKILL" in row["what"], row
    assert row["last_step"] >= 30
    asked_dead_pid(cli, job.pid, "killed", "SIGKILL", frame=None)  # wherever the last snapshot found the loop


@requires_torch
def test_a_native_crash_is_reported_from_the_fatal_signal_dump(spawn, cli):
    # given: a job with periodic snapshots that crashes in C (ctypes.string_at(0)) at step 200
    job = spawn([TARGETS / "dies.py", "--how", "segv", "--steps", "200"], env={"PROBE_POSTMORTEM_EVERY": "0.1"})
    job.popen.wait(60)
    assert job.popen.returncode == -signal.SIGSEGV
    # then: listed as a fatal signal, its tables from the last snapshot, its stacks from faulthandler's dump
    row = dead(cli, job.pid)
    assert row["cause"] == "fatal_signal" and "Segmentation fault" in row["what"], row
    asked_dead_pid(cli, job.pid, "fatal_signal", "Segmentation fault", frame="string_at")
    q = cli(
        str(job.pid),
        "--format",
        "json",
        "query",
        "SELECT func FROM python.backtrace WHERE is_main ORDER BY depth LIMIT 2",
    )
    assert [r["func"] for r in json.loads(q.stdout)] == ["string_at", "<module>"], q.stdout + q.stderr


def test_records_are_bounded(spawn, cli):
    pids = []
    for _ in range(3):
        p = spawn([sys.executable, "-c", "import probe.auto"], env={"PROBE_POSTMORTEM_KEEP": "2"}, ready=None)
        assert p.popen.wait(60) == 0, p.output()
        pids.append(p.pid)
    r = cli("list", "--dead", "--json")
    listed = [row["pid"] for row in json.loads(r.stdout)]
    assert listed == [pids[2], pids[1]], (listed, pids)  # newest first, the oldest removed


@requires_torch
def test_a_killed_rank_is_dead_in_status_and_the_doctor_names_it():
    # given: a 3-rank DDP job whose survivors stay alive when a peer dies (each rank its own process:
    # torchrun would tear the others down), with a fast periodic snapshot
    from _ranks import ddp_job, states, until_status

    with ddp_job("--survive", extra_env={"PROBE_POSTMORTEM_EVERY": "0.3"}) as job:
        rt = job.env["PROBE_RUNTIME_DIR"]
        assert poll(lambda: os.path.isdir(os.path.join(rt, "postmortem", str(job.pids[1]))), 60), (
            "no snapshot of rank 1"
        )
        # when: rank 1 is killed without warning while the others train with it
        os.kill(job.pids[1], signal.SIGKILL)
        # then: status shows it dead (how, at which step), the culprit the others wait for
        r, rows = until_status(
            job, time.monotonic(), lambda rows: states(rows) == {0: "waiting", 1: "dead", 2: "waiting"}
        )
        assert r.returncode == 0, r.stderr
        dead_row = rows[1]
        assert dead_row["culprit"] and dead_row["pid"] == job.pids[1] and dead_row["step"] >= 1, dead_row
        assert dead_row["reason"].startswith(f"died at step {dead_row['step']} (killed)"), dead_row
        assert "ranks 0,2 wait for it" in dead_row["reason"], dead_row
        # the doctor names it, with how it died and who waits
        # (a generous timeout: the doctor snapshots whole tables of every rank, slow on a loaded 2-core machine)
        d = job.cli("--timeout", "30", "--ranks", "all", "--format", "json", "doctor")
        assert d.returncode == 8, d.stderr
        died = [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "rank_died"]
        assert len(died) == 1 and died[0]["rank"] == 1, d.stdout
        assert died[0]["message"].startswith(f"rank 1 died at step {dead_row['step']} (killed)"), died
        assert "; ranks 0,2 wait for it" in died[0]["message"], d.stdout
        assert not [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "hung_rank"], d.stdout
        # --ranks all query has its rows, and says where they come from
        q = job.cli(
            "--ranks",
            "all",
            "--format",
            "json",
            "query",
            "SELECT i.rank, i.source, i.state, max(s.step) AS last FROM process.info i JOIN torch.steps s "
            "ON s.rank = i.rank GROUP BY ALL ORDER BY i.rank",
        )
        assert q.returncode == 0, q.stderr
        got = {row["rank"]: row for row in json.loads(q.stdout)}
        assert [got[r]["source"] for r in (0, 1, 2)] == ["live", "postmortem", "live"], got
        assert got[1]["state"] == "dead" and got[1]["last"] == dead_row["step"], got
        # and --rank 1 reads its record like any rank
        bt = job.cli("--rank", "1", "backtrace")
        assert bt.returncode == 0 and "post-mortem record" in bt.stdout and "ddp_plain.py" in bt.stdout, (
            bt.stdout + bt.stderr
        )


def listed_dead(cli) -> list:
    r = cli("list", "--dead", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@requires_torch
def test_a_live_process_whose_worker_thread_died_is_not_dead(spawn, cli, probe_env):
    # given: a job whose worker thread dies while its loop goes on (its record says thread_exception)
    job = spawn([TARGETS / "dies.py", "--how", "thread", "--steps", "30"], env={"PROBE_POSTMORTEM_EVERY": "0"})
    job.wait_for("CUDA out of memory")  # printed by the chained hook, after the record is written
    meta = json.load(open(os.path.join(probe_env["PROBE_RUNTIME_DIR"], "postmortem", str(job.pid), "meta.json")))
    assert meta["cause"] == "thread_exception" and meta["proc_start"], meta["cause"]
    # then: it is not listed as dead, and it still answers as itself
    assert job.pid not in [r["pid"] for r in listed_dead(cli)]
    q = cli(str(job.pid), "--format", "json", "query", "SELECT source, state FROM process.info")
    assert q.returncode == 0 and json.loads(q.stdout)[0]["source"] == "live", q.stdout + q.stderr
    # when it is then killed without warning: dead, and its record names the thread that died first
    os.kill(job.pid, signal.SIGKILL)
    job.popen.wait(10)
    row = dead(cli, job.pid)
    assert row["cause"] == "killed" and "SIGKILL" in row["what"], row
    assert "thread data-prefetch died of RuntimeError: CUDA out of memory" in row["what"], row
    d = cli(str(job.pid), "--format", "json", "doctor")
    died = [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "rank_died"]
    assert d.returncode == 8 and died and "thread data-prefetch died of RuntimeError" in died[0]["message"], d.stdout


def test_a_reused_pid_is_told_apart_by_its_start_time(spawn, cli, probe_env):
    # given: the record of a process that exited, and a live process (not probed) holding another pid
    gone = spawn([sys.executable, "-c", "import probe.auto"], ready=None)
    assert gone.popen.wait(60) == 0, gone.output()
    base = os.path.join(probe_env["PROBE_RUNTIME_DIR"], "postmortem")
    meta = json.load(open(os.path.join(base, str(gone.pid), "meta.json")))
    live = spawn([sys.executable, "-c", "import signal; print('ready', flush=True); signal.pause()"])
    with open(f"/proc/{live.pid}/stat") as f:
        live_start = int(f.read().rsplit(")", 1)[1].split()[19])
    assert meta["proc_start"] and meta["proc_start"] != live_start

    os.rename(os.path.join(base, str(gone.pid)), os.path.join(base, str(live.pid)))

    def planted(start):  # the record as if its pid had been the live one's, its process started at ``start``
        meta.update(pid=live.pid, proc_start=start)
        with open(os.path.join(base, str(live.pid), "meta.json"), "w") as f:
            json.dump(meta, f)

    # when the live pid started after the record's process: the pid was reused, the record's process is dead
    planted(meta["proc_start"])
    assert live.pid in [r["pid"] for r in listed_dead(cli)]
    # when the live process is the record's own (same start time): never listed as dead
    planted(live_start)
    assert live.pid not in [r["pid"] for r in listed_dead(cli)]


def test_retention_evicts_clean_exits_before_crashes_and_exit_codes(spawn, cli):
    # given: a crash and a sys.exit(3), then more clean exits than the keep limit
    env = {"PROBE_POSTMORTEM_KEEP": "3"}
    crash = spawn([sys.executable, "-c", "import probe.auto\nraise RuntimeError('planted crash')"], env=env, ready=None)
    assert crash.popen.wait(60) == 1, crash.output()
    failed = spawn([sys.executable, "-c", "import probe.auto, sys; sys.exit(3)"], env=env, ready=None)
    assert failed.popen.wait(60) == 3, failed.output()
    clean = []
    for _ in range(3):
        p = spawn([sys.executable, "-c", "import probe.auto"], env=env, ready=None)
        assert p.popen.wait(60) == 0, p.output()
        clean.append(p.pid)
    # then: the clean exits went first; the crash and the failed exit stay
    rows = listed_dead(cli)
    assert [r["pid"] for r in rows] == [clean[2], failed.pid, crash.pid], rows
    assert rows[1]["cause"] == "exit" and rows[1]["what"] == "exited with code 3 (sys.exit(3))", rows
    assert rows[2]["cause"] == "exception" and "planted crash" in rows[2]["what"], rows


def test_fatal_dumps_are_bounded_with_the_records(spawn, cli, probe_env):
    rt = probe_env["PROBE_RUNTIME_DIR"]
    env = {"PROBE_POSTMORTEM_KEEP": "2", "PROBE_POSTMORTEM_EVERY": "0"}
    # given: a SIGKILLed process (an empty dump) and three native crashes before any record (dumps alone)
    killed = spawn(
        [sys.executable, "-c", "import probe.auto, os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        env=env,
        ready=None,
    )
    assert killed.popen.wait(60) == -signal.SIGKILL
    crashes = []
    for _ in range(3):
        p = spawn([sys.executable, "-c", "import probe.auto, ctypes; ctypes.string_at(0)"], env=env, ready=None)
        assert p.popen.wait(60) == -signal.SIGSEGV, p.output()
        crashes.append(p.pid)
    # when: a process writes a record
    last = spawn([sys.executable, "-c", "import probe.auto"], env=env, ready=None)
    assert last.popen.wait(60) == 0
    # then: the empty dump is gone, the dumps count as records within the limit (oldest evicted)
    fatal = sorted(n for n in os.listdir(rt) if n.startswith("fatal-"))
    assert fatal == [f"fatal-{crashes[2]}.txt"], fatal
    rows = listed_dead(cli)
    assert [(r["pid"], r["cause"]) for r in rows] == [(last.pid, "exit"), (crashes[2], "fatal_signal")], rows


@requires_torch
def test_sigterm_kills_a_rank_waiting_in_c_as_promptly_as_without_probe(spawn, cli):
    # given: the same job twice, its main thread waiting in C (GIL released) and never back in Python,
    # as a gloo rank in an all_reduce whose peer never comes; once plain, once under PROBE=1
    for probed in (False, True):
        job = spawn([TARGETS / "blocked_in_c.py"], env={"PROBE": "1"} if probed else {})
        assert f"probe_loaded={probed}" in job.output(), job.output()
        # when: it is stopped as torchrun and schedulers do
        sent = time.time()
        os.kill(job.pid, signal.SIGTERM)
        # then: it dies of SIGTERM by itself (nothing here sends SIGKILL), with and without the probe
        try:
            job.popen.wait(60)
        except Exception:
            raise AssertionError(f"probed={probed}: still alive after SIGTERM ({job.popen.poll()})") from None
        gone = time.time()
        assert job.popen.returncode == -signal.SIGTERM, (probed, job.popen.returncode)
    # and the probed one's record says SIGTERM, written between the signal and the death, with the main
    # thread where it waited
    row = dead(cli, job.pid)
    assert row["cause"] == "terminated" and "terminated by SIGTERM" in row["what"], row
    assert row["last_step"] == 20, row
    bt = cli(str(job.pid), "backtrace")
    assert bt.returncode == 0 and "post-mortem record" in bt.stdout, bt.stdout + bt.stderr
    main = bt.stdout.split('"MainThread" (main)', 1)[1].split("\nThread ", 1)[0]
    assert "blocked_in_c.py" in main and "wait" in main, bt.stdout
    assert "probe-sigterm" not in bt.stdout and "probe-postmortem-term" not in bt.stdout, bt.stdout
    with open(os.path.join(row["record"], "meta.json")) as f:
        meta = json.load(f)
    assert sent <= meta["time"] <= gone and meta["detail"] == "SIGTERM", (sent, meta["time"], gone, meta["detail"])


@requires_torch
def test_sigterm_is_recorded_with_the_stacks_at_that_moment(spawn, cli, probe_env):
    # given: a training job with no periodic snapshot (only the SIGTERM handler can speak for it)
    job = spawn([TARGETS / "dies.py", "--how", "wait", "--steps", "30"], env={"PROBE_POSTMORTEM_EVERY": "0"})
    # when: it is stopped as torchrun and schedulers do
    os.kill(job.pid, signal.SIGTERM)
    job.popen.wait(30)
    assert job.popen.returncode == -signal.SIGTERM  # it still dies of SIGTERM
    # then: terminated by SIGTERM, its steps, and the main thread's stack where the signal found it
    row = dead(cli, job.pid)
    assert row["cause"] == "terminated" and "terminated by SIGTERM" in row["what"], row
    assert row["last_step"] >= 30, row
    assert not os.path.exists(os.path.join(probe_env["PROBE_RUNTIME_DIR"], f"fatal-{job.pid}.txt"))
    bt = cli(str(job.pid), "backtrace")
    assert bt.returncode == 0 and "post-mortem record" in bt.stdout, bt.stdout + bt.stderr
    main = bt.stdout.split('"MainThread" (main)', 1)[1].split("\nThread ", 1)[0]
    assert "dies.py" in main and "on_term" not in main and "agent/watchdog.py" not in main, bt.stdout
    assert "probe-postmortem-term" not in bt.stdout, bt.stdout  # the writer leaves itself out
    # a deliberate stop is no rank_died finding while nobody waits for it
    d = cli(str(job.pid), "--format", "json", "doctor")
    assert not [f for f in json.loads(d.stdout)["findings"] if f["rule"] == "rank_died"], d.stdout


@requires_torch
def test_ranks_all_with_only_ended_jobs_says_no_job_is_running(spawn, cli):
    # given: two jobs that ran here and ended (their ranks left records), none running
    for run in ("job-a", "job-b"):
        job = spawn(
            [TARGETS / "dies.py", "--how", "exit", "--steps", "3"],
            env={"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": run},
        )
        assert job.popen.wait(60) == 0
    # when: every rank is asked for
    r = cli("--ranks", "all", "status")
    # then: one sentence saying that no job runs, naming the ended ones, no traceback
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "no job is running here" in r.stderr and "job-a, job-b" in r.stderr, r.stderr
    # and one ended job's records are still there to read with --job
    r = cli(
        "--ranks",
        "all",
        "--job",
        "job-a",
        "query",
        "SELECT rank, MAX(step) AS step FROM torch.steps GROUP BY rank",
        "--format",
        "json",
    )
    assert r.returncode == 0 and json.loads(r.stdout) == [{"rank": 0, "step": 3}], r.stdout + r.stderr


def test_a_sigterm_handler_the_program_installs_later_keeps_the_signal(spawn):
    # given: a probed program that installs its own SIGTERM handler after the probe started (graceful preemption,
    # as Lightning's and the HF Trainer's do)
    code = (
        "import os, signal, sys, time\n"
        "import probe.auto\n"
        "stop = []\n"
        "signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))\n"
        "print(f'ready pid={os.getpid()}', flush=True)\n"
        "while not stop:\n"
        "    time.sleep(0.05)  # ok-sleep: the program idles until its handler runs\n"
        "print('graceful stop', flush=True)\n"
        "sys.exit(0)\n"
    )
    job = spawn([sys.executable, "-c", code])
    # when
    os.kill(job.pid, signal.SIGTERM)
    # then: the program's handler ran and it exited as it chose, not killed by the probe's watcher
    assert job.popen.wait(60) == 0, job.output()
    job.wait_for("graceful stop", 10)


def _rows(cli, pid: int, table: str) -> list:
    r = cli(str(pid), "--format", "json", "query", "--max-rows", "100000", f"SELECT * FROM {table}")
    assert r.returncode == 0 and "Warning" not in r.stderr, (table, r.stderr)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def live_then_dead(shared_spawn, shared_cli):
    """A training loop (two optimizers, module traces, steps measured and not) that has stopped stepping: every
    table the process serves (probe.tables, less those the client computes) read live, then the process stopped
    with SIGTERM (its record written at death)."""
    from concurrent.futures import ThreadPoolExecutor

    job = shared_spawn([TARGETS / "torch_loops.py", "--steps", "40"], env={"PROBE_POSTMORTEM_EVERY": "0"})
    listed = json.loads(
        shared_cli(
            str(job.pid), "--format", "json", "query", "SELECT name, kind FROM probe.tables WHERE kind <> 'client'"
        ).stdout
    )
    with ThreadPoolExecutor(2) as pool:
        live = dict(zip([t["name"] for t in listed], pool.map(lambda t: _rows(shared_cli, job.pid, t["name"]), listed)))
    os.kill(job.pid, signal.SIGTERM)
    job.popen.wait(30)
    return job.pid, live, {t["name"]: t["kind"] for t in listed}


def _ordered(rows: list, ids: list) -> list:
    return sorted(rows, key=lambda r: json.dumps([r[c] for c in ids]))


def _same(a, b) -> bool:
    return a == b or isinstance(a, float) and isinstance(b, float) and a != a and b != b


@requires_torch
def test_a_record_holds_what_the_live_tables_held(live_then_dead, shared_cli):
    # given: every table read live, then the process dead
    pid, live, kinds = live_then_dead
    kept = json.loads(shared_cli(str(pid), "--format", "json", "tables").stdout)
    kept = [t["name"] for t in kept]
    assert {"torch.steps", "python.torch_trace", "torch.optimizer_steps", "process.info"} <= set(kept), kept
    # the loop left NULLs to keep: unmeasured steps, backward traces without output statistics
    assert any(r["grad_norm"] is None for r in live["torch.steps"]), live["torch.steps"][-1]
    assert any(r["grad_norm"] is not None for r in live["torch.steps"]), live["torch.steps"][0]
    assert any(r["out_std"] is None for r in live["python.torch_trace"]), live["python.torch_trace"][:2]
    overlay = {"source", "state", "exit_cause", "exited_at", "exit_reason"}  # process.info says how it ended
    for table in kept:
        # when: the record is read as the dead process's table
        dead = _rows(shared_cli, pid, table)
        before = live[table]
        if before and dead:
            assert list(dead[0]) == list(before[0]), table  # the same columns in the same order
        if kinds[table] == "ring":
            # then: the rows the loop wrote (it stepped no more) come back cell for cell, NULL for NULL; rows are
            # matched by their whole numbers and texts that are never NULL (step, seq, module, ...)
            ids = [c for c in (before[0] if before else ()) if all(isinstance(r[c], (int, str)) for r in before)]
            for was, now in zip(_ordered(before, ids), _ordered(dead, ids)):
                bad = {c: (was[c], now[c]) for c in was if not _same(was[c], now[c])}
                assert not bad, (table, was, bad)
            assert len(dead) == len(before), (table, len(before), len(dead))
            continue
        # a point-in-time table is read again at death: a column NULL in every live row is NULL in every row of
        # the record, one never NULL live is never NULL there, and no NULL came back as NaN
        for c in before[0] if before and dead else ():
            if c in overlay and table == "process.info":
                continue
            nulls_live = {r[c] is None for r in before}
            nulls_dead = {r[c] is None for r in dead}
            assert nulls_live == nulls_dead or len(nulls_live) == 2, (table, c, nulls_live, nulls_dead)
            assert not any(isinstance(r[c], float) and r[c] != r[c] for r in dead), (table, c)


@requires_torch
def test_the_doctor_on_a_dead_pid_reads_nulls_as_unknown_and_names_the_missing_tables_once(live_then_dead, shared_cli):
    # given: a dead process whose unmeasured steps have no CPU wait (NULL)
    pid, _, _ = live_then_dead
    # when: the doctor reads its record, info findings and skipped rules included
    d = shared_cli(str(pid), "doctor", "--all")
    # then: no rule read a NULL as a number ("waited nan ms"), and the tables the record does not keep are one line
    assert d.returncode in (0, 8) and "Traceback" not in d.stderr, d.stdout + d.stderr
    assert not re.search(r"\bnan\b", d.stdout + d.stderr, re.IGNORECASE), d.stdout
    skipped = d.stdout.split("Rules that could not run here:\n", 1)[1].splitlines()
    lacking = [line for line in skipped if "the post-mortem record does not keep" in line]
    assert len(lacking) == 1 and "torch.parameters" in lacking[0] and "torch.checks" in lacking[0], d.stdout
    assert "known tables" not in d.stdout and len(skipped) <= 3, d.stdout
    # and --format json still names each rule with the table it reads
    doc = json.loads(shared_cli(str(pid), "doctor", "-f", "json").stdout)
    reads = {s["rule"]: s.get("table") for s in doc["rules_skipped"]}
    assert reads.get("grads_by_layer") == "torch.parameters", doc["rules_skipped"]


@requires_torch
def test_list_dead_takes_f_json_like_format_json(live_then_dead, shared_cli):
    pid, _, _ = live_then_dead
    short = shared_cli("list", "--dead", "-f", "json")
    assert short.returncode == 0, short.stderr
    assert short.stdout == shared_cli("list", "--dead", "--format", "json").stdout
    assert pid in [row["pid"] for row in json.loads(short.stdout)], short.stdout
