"""`probe ui` in a real headless Chromium (Debian's, driven by Playwright) against a real
training example: the page loads offline without console errors, its curves show what
torch.steps holds, the SQL console answers, the flamegraph finds the training loop, and
the page keeps updating. Screenshots go to $PROBE_UI_ARTIFACTS (default
/tmp/probe-ui-artifacts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import EXAMPLES, PROBE_BIN, TARGETS, poll, requires_torch
from harness import run_probe, start, stop_groups

CHROMIUM = os.environ.get("PROBE_TEST_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("PROBE_UI_ARTIFACTS", "/tmp/probe-ui-artifacts"))

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements/test.txt)")
pytestmark = requires_torch


class UI:
    """A running `probe ui` and the URL it printed."""

    def __init__(self, env, *args):
        # its last line before serving: the URL lines (the 127.0.0.1 one comes after "serving") are in by then
        self.proc = start([PROBE_BIN, *args], env, ready="Ctrl-C stops it", timeout=30)
        self.lines = self.proc.lines
        urls = [m.group(0) for line in self.lines for m in [re.search(r"http://127\.0\.0\.1:\d+/\S+/", line)] if m]
        assert urls, "probe ui did not print its URL:\n" + "\n".join(self.lines)
        self.url = urls[0]
        self.origin = re.match(r"http://127\.0\.0\.1:\d+", self.url).group(0)

    def close(self):
        stop_groups([self.proc.popen], grace=5)


@pytest.fixture(scope="module")
def train(shared_spawn):
    """The training example for the whole file; the page only reads it, so it steps every ~0.1 s
    (--step-sleep) rather than taking a core from the browser and the `probe` calls."""
    return shared_spawn(
        [EXAMPLES / "train_gpt.py", "--print-every", "100000", "--step-sleep", "0.1"], ready="ready pid=", timeout=120
    )


@pytest.fixture(scope="module")
def ui(train, shared_env):
    server = UI(shared_env, train.pid, "ui", "--port", "0", "--refresh", "1")
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        missing = f"no Chromium at {CHROMIUM}; run-tests installs Debian's chromium (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(missing)  # in CI a skipped browser test would hide a broken install step
        pytest.skip(missing)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, ui):
    """The page, loaded once for the file; records console messages, page errors and every request."""
    pg = browser.new_page(viewport={"width": 1400, "height": 1700})
    pg.console_errors, pg.requests = [], []
    pg.on("console", lambda m: m.type in ("error", "warning") and pg.console_errors.append(f"{m.type}: {m.text}"))
    pg.on("pageerror", lambda e: pg.console_errors.append(f"pageerror: {e}"))
    pg.on("request", lambda r: pg.requests.append(r.url))
    started = time.perf_counter()
    pg.goto(ui.url)
    pg.wait_for_selector("body[data-loaded='1']", timeout=60000)
    pg.load_seconds = time.perf_counter() - started
    yield pg
    pg.screenshot(path=str(ARTIFACTS / "ui-final.png"), full_page=True)
    pg.close()


def open_page(browser, url):
    """A new page at ``url``, loaded; returns (page, console errors seen so far and later)."""
    pg = browser.new_page(viewport={"width": 1400, "height": 1700})
    errors: list[str] = []
    pg.on("console", lambda m: m.type == "error" and errors.append(m.text))
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(url)
    pg.wait_for_selector("body[data-loaded='1']", timeout=60000)
    return pg, errors


def cli_json(env, *args):
    r = run_probe(*args, "--format", "json", env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_page_loads_offline_without_console_errors(page, ui):
    page.screenshot(path=str(ARTIFACTS / "ui-loaded.png"), full_page=True)
    assert page.console_errors == [], (page.console_errors, ui.lines)
    leaving = [u for u in page.requests if not u.startswith(ui.origin + "/") and not u.startswith("data:")]
    assert leaving == [], leaving
    # every panel whose table exists is shown and answered without an error
    for panel in ("job", "curves", "time", "stacks", "sql", "actions"):
        assert page.is_visible(f"#{panel}"), panel
        assert page.inner_text(f"#{panel} .err") == "", panel
    assert "training" in page.inner_text("#job")
    print(f"page load to first data: {page.load_seconds:.2f} s")


def test_wrong_or_missing_token_gets_403(ui):
    wrong = re.sub(r"/[^/]+/$", "/" + "x" * 32 + "/", ui.url)
    for url in (wrong, ui.origin + "/", ui.origin + "/api/job", wrong + "api/job", wrong + "app.js"):
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(url, timeout=10)
        assert exc.value.code == 403, url
    with urllib.request.urlopen(ui.url.rstrip("/"), timeout=10) as resp:  # redirected to the URL with its slash
        assert resp.status == 200 and resp.url == ui.url and b"app.js" in resp.read()
    with urllib.request.urlopen(ui.url + "api/config", timeout=10) as resp:
        assert resp.status == 200 and "default-src 'none'" in resp.headers["Content-Security-Policy"]


def test_curves_show_the_steps_of_torch_steps(page, shared_env, train):
    legend = page.wait_for_selector("#chart-loss .legend .latest", timeout=30000)
    step, value = int(legend.get_attribute("data-step")), float(legend.get_attribute("data-value"))
    rows = cli_json(shared_env, train.pid, "query", f"SELECT loss FROM torch.steps WHERE step = {step}")
    assert rows and rows[0]["loss"] == pytest.approx(value, rel=1e-9), (step, value, rows)
    # the line has one vertex per step the window holds
    d = page.get_attribute("#chart-loss path[data-series]", "d")
    assert d.count("L") >= 2
    # the learning-rate chart agrees with the table at its own latest step
    lr = page.query_selector("#chart-lr .legend .latest")
    rows = cli_json(
        shared_env, train.pid, "query", f"SELECT lr FROM torch.steps WHERE step = {lr.get_attribute('data-step')}"
    )
    assert rows[0]["lr"] == pytest.approx(float(lr.get_attribute("data-value")), rel=1e-9)


def test_sql_console_returns_rows_and_charts_a_column(page):
    page.fill("#sql-text", "SELECT step, loss FROM torch.steps WHERE step <= 3 ORDER BY step")
    page.press("#sql-text", "Control+Enter")
    page.wait_for_function("() => document.querySelectorAll('#sql-result tbody tr').length === 3", timeout=30000)
    steps = page.eval_on_selector_all("#sql-result tbody tr td:first-child", "tds => tds.map(td => td.textContent)")
    assert steps == ["1", "2", "3"]
    assert page.input_value("#sql-chart") == "loss"
    assert page.query_selector("#sql-chart-box path[data-series]") is not None
    # a refused query is one sentence in the panel, not a broken page
    page.fill("#sql-text", "DELETE FROM torch.steps")
    page.click("#sql-run")
    page.wait_for_function("() => document.querySelector('#sql .err').textContent.length > 0", timeout=30000)
    assert "Traceback" not in page.inner_text("#sql .err")
    # and the next good query clears the error and shows its rows
    page.fill("#sql-text", "SELECT step, loss, grad_norm FROM torch.steps ORDER BY step DESC LIMIT 200")
    page.click("#sql-run")
    page.wait_for_function("() => document.querySelectorAll('#sql-result tbody tr').length > 3", timeout=30000)
    assert page.inner_text("#sql .err") == ""


def test_flamegraph_contains_the_training_loop(page):
    page.fill("#flame-seconds", "1")
    page.click("#flame-run")
    page.wait_for_selector("#flame-box g[data-name^='main (train_gpt.py:']", timeout=30000)
    assert page.query_selector("#flame-box g[data-name='thread MainThread']") is not None
    page.screenshot(path=str(ARTIFACTS / "ui-flamegraph.png"), full_page=True)  # docs/ui.png is one of these
    # clicking a box zooms into it: it then spans the full width
    page.click("#flame-box g[data-name^='main (train_gpt.py:'] rect")
    width = float(page.get_attribute("#flame-box g[data-name^='main (train_gpt.py:'] rect", "width"))
    assert width >= float(page.eval_on_selector("#flame-box svg", "s => s.getAttribute('width')")) - 1


def test_page_keeps_updating_as_steps_advance(page, ui):
    def latest():
        v = page.get_attribute("#chart-loss", "data-last-step")
        return int(v) if v else 0

    first = latest()
    assert poll(lambda: latest() > first, timeout=30), f"the loss chart stayed at step {first}"
    assert page.console_errors == [], (page.console_errors, ui.lines)


def test_a_panel_is_shown_exactly_when_its_table_exists(page, shared_env, train):
    names = {t["name"] for t in cli_json(shared_env, train.pid, "tables")}
    needs = page.eval_on_selector_all(
        ".panel[data-needs]:not([data-needs=''])", "ps => ps.map(p => [p.id, p.dataset.needs, !p.hidden])"
    )
    assert {n for _, n, _ in needs} >= {"torch.steps", "python.torch_trace", "probe.actions"}
    for panel, table, shown in needs:
        assert shown == (table in names), (panel, table, shown)


def test_findings_panel_shows_the_doctor(page, shared_env, train):
    page.wait_for_function(
        "() => document.querySelector('#findings-meta').textContent.includes('rules over')", timeout=30000
    )
    assert page.inner_text("#findings .err") == ""
    r = run_probe(train.pid, "doctor", "--format", "json", env=shared_env, timeout=60)
    doc = json.loads(r.stdout)
    assert f"{doc['rules_run']} rules over 1 of 1 process" in page.inner_text("#findings-meta")
    shown = page.eval_on_selector_all("#findings .finding", "fs => fs.map(f => f.dataset.rule)")
    # findings depend on the moment (step times, ages); the page shows some or says none
    assert shown or "nothing wrong found" in page.inner_text("#findings .body")


def test_actions_only_with_allow_actions_and_a_confirmation(browser, train, shared_env, ui):
    # without --allow-actions the API refuses (a request with the page's CSRF header, as the page sends)
    with urllib.request.urlopen(ui.url + "api/config", timeout=10) as resp:
        csrf = json.loads(resp.read())["csrf"]
    req = urllib.request.Request(
        ui.url + "api/action",
        data=b'{"name": "cleanup", "confirmed": true}',
        method="POST",
        headers={"X-Probe-CSRF": csrf},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert "actions are off" in json.loads(resp.read())["error"]
    server = UI(shared_env, train.pid, "ui", "--port", "0", "--allow-actions", "--refresh", "1")
    pg, errors = open_page(browser, server.url)
    try:
        dialogs, accept = [], {"yes": False}
        pg.on("dialog", lambda d: (dialogs.append(d.message), d.accept() if accept["yes"] else d.dismiss()))
        before = cli_json(shared_env, train.pid, "query", "SELECT id FROM probe.actions WHERE command = 'cleanup'")
        # declined: nothing is sent
        pg.click("#action-buttons button:text('cleanup')")
        assert poll(lambda: dialogs, 10), "no confirmation was asked"
        assert "cleanup" in dialogs[0]
        # confirmed: the action runs at the next step boundary and shows in the log
        accept["yes"] = True
        pg.click("#action-buttons button:text('cleanup')")
        pg.wait_for_function(
            "() => [...document.querySelectorAll('#actions tbody td')].some(td => td.textContent === 'cleanup')",
            timeout=30000,
        )
        after = cli_json(shared_env, train.pid, "query", "SELECT id FROM probe.actions WHERE command = 'cleanup'")
        assert len(after) == len(before) + 1, (before, after)
        assert errors == [], (errors, server.lines)
    finally:
        pg.close()
        server.close()


def test_non_loopback_needs_expose_and_warns(train, shared_env):
    r = subprocess.run(
        [PROBE_BIN, str(train.pid), "ui", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        env=shared_env,
        timeout=30,
    )
    assert r.returncode != 0 and "not a loopback address; add --expose" in r.stderr and "Traceback" not in r.stderr
    server = UI(shared_env, train.pid, "ui", "--host", "0.0.0.0", "--expose", "--port", "0")
    try:
        assert poll(lambda: any("WARNING: listening on 0.0.0.0" in line for line in server.lines), 10), server.lines
        assert any(line.startswith("probe ui: from a laptop: ssh -N -L ") for line in server.lines), server.lines
    finally:
        server.close()


def test_ranks_page_federates_every_rank(browser, spawn, probe_env):
    # given: two probed processes of a job of world size 2 (plain Python, no torch)
    procs = [spawn(TARGETS / "idle.py", env={"RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)]
    server = UI(probe_env, "--ranks", "all", "ui", "--port", "0")
    pg, errors = open_page(browser, server.url)
    try:
        # then: one job row per rank, the stacks of both, and a flamegraph with a root per rank
        ranks = pg.eval_on_selector_all("#job tbody tr td:first-child", "tds => tds.map(td => td.textContent)")
        assert ranks == ["0", "1"], ranks
        assert "main_loop" in pg.inner_text("#stacks") and "ranks 0-1" in pg.inner_text("#stacks")
        pg.fill("#sql-text", "SELECT rank, pid FROM process.info ORDER BY rank")
        pg.click("#sql-run")
        pg.wait_for_function("() => document.querySelectorAll('#sql-result tbody tr').length === 2", timeout=30000)
        pids = pg.eval_on_selector_all("#sql-result tbody tr td:nth-child(2)", "tds => tds.map(td => td.textContent)")
        assert pids == [str(p.pid) for p in procs]
        pg.fill("#flame-seconds", "1")
        pg.click("#flame-run")
        pg.wait_for_selector("#flame-box g[data-name='rank 1']", timeout=30000)
        assert pg.query_selector("#flame-box g[data-name='rank 0']") is not None
        pg.screenshot(path=str(ARTIFACTS / "ui-ranks.png"), full_page=True)
        assert errors == [], (errors, server.lines)
    finally:
        pg.close()
        server.close()


def test_findings_panel_names_a_planted_nan(browser, spawn, probe_env):
    # given: a job whose data turns the loss into NaN (started with PROBE=1, no probe code in it)
    job = spawn(
        [TARGETS / "faults.py", "--fault", "nan_from_data", "--settle", "30"],
        env={"PROBE": "1"},
        ready="planted",
        timeout=180,
    )
    server = UI(probe_env, job.pid, "ui", "--port", "0")
    pg, errors = open_page(browser, server.url)
    try:
        # then: the findings panel shows a critical finding about non-finite values, with a next command
        finding = pg.wait_for_selector("#findings .finding.sev-critical", timeout=60000)
        assert "NaN" in finding.inner_text() and "next: probe" in finding.inner_text()
        # the loss is NaN from the fault on (torch.steps keeps it NaN, not NULL): the chart marks those steps
        marker = pg.wait_for_selector("#chart-loss path.nan", timeout=30000)
        assert re.search(r": NaN at step \d+", marker.text_content()), marker.text_content()
        pg.screenshot(path=str(ARTIFACTS / "ui-nan.png"), full_page=True)
        assert errors == [], (errors, server.lines)
    finally:
        pg.close()
        server.close()


def test_a_fast_job_has_its_loss_curve_drawn_at_every_step_in_view(browser, spawn, probe_env):
    # given: a job of ~1 ms steps (after a first run of 300 flat out), whose budget measures few of them
    job = spawn([TARGETS / "budget_loop.py", "--steps", "300", "--then-sleep", "0.001"], env={"PROBE": "1"})
    server = UI(probe_env, job.pid, "ui", "--port", "0", "--refresh", "1")
    pg, errors = open_page(browser, server.url)
    try:

        def counted():
            c = pg.query_selector("#chart-loss .head .count")
            shown = int(c.get_attribute("data-shown") or 0) if c else 0
            return c if shown >= 500 else None

        count = poll(counted, timeout=60)
        assert count is not None, pg.inner_text("#curves")
        # then: the panel says how many steps in view carry the loss (all, bar a few still being read)...
        # (read in one go: the page redraws every second)
        shown, carried, text, points = pg.evaluate("""() => {
            const c = document.querySelector('#chart-loss .head .count');
            const p = document.querySelector('#chart-loss path[data-series]');
            return [+c.dataset.shown, +c.dataset.carried, c.textContent, +p.dataset.points]; }""")
        assert carried >= 0.99 * shown and text == f"{carried} of {shown} steps", (carried, shown, text)
        # ...and the curve has one vertex per step that carries it, not a line between a few measured points
        assert points == carried, (points, carried)
        pg.screenshot(path=str(ARTIFACTS / "ui-fast-loss.png"), full_page=True)
        assert errors == [], (errors, server.lines)
    finally:
        pg.close()
        server.close()


def test_an_empty_panel_says_why_and_an_axis_keeps_one_format(browser, spawn, probe_env):
    # given: a classifier on float features (faults.py): its inputs are counted (samples), none holds token ids
    job = spawn([TARGETS / "faults.py"], env={"PROBE": "1"}, timeout=180)
    server = UI(probe_env, job.pid, "ui", "--port", "0", "--refresh", "1")
    pg, errors = open_page(browser, server.url)
    try:
        # then: the tokens/s panel, with no value to draw, says why
        why = pg.wait_for_selector("#chart-tokens_per_s .legend .why", timeout=60000)
        assert "the model's inputs are not integer token ids" in why.inner_text(), pg.inner_text("#curves")
        # and: an axis across 0.01 (a learning rate warming up) is labelled in one format, as every chart's is
        assert pg.evaluate("() => ticks([0.0089, 0.0094, 0.0099, 0.0104])") == ["0.0089", "0.0094", "0.0099", "0.0104"]
        assert pg.evaluate("() => ticks([0.0021, 0.0042, 0.0063, 0.0084])") == ["2.1e-3", "4.2e-3", "6.3e-3", "8.4e-3"]
        charts = pg.eval_on_selector_all(
            ".chart", "cs => cs.map(c => [c.id, [...c.querySelectorAll('text.tick')].map(t => t.textContent)])"
        )
        for name, labels in charts:
            assert len(labels) in (0, 4) and len({"e" in t for t in labels}) <= 1, (name, labels)
        pg.screenshot(path=str(ARTIFACTS / "ui-empty-panel.png"), full_page=True)
        assert errors == [], (errors, server.lines)
    finally:
        pg.close()
        server.close()
