// probe ui: the live page of a training job. Hand-written, no dependencies, no network
// beyond this page's own origin. Every panel is one request to the `probe ui` server,
// which answers through the CLI's client and fan-out. URLs are relative: the token in
// the page's path travels with them.
"use strict";

const state = { config: {}, tables: {}, timer: null, refresh: 3, busy: false, flame: null, sqlResult: null, curves: new Map(), curvesMax: null };

async function call(method, path, body) {
  const opts = { method, headers: {} };
  if (body !== undefined) { opts.body = JSON.stringify(body); opts.headers["Content-Type"] = "application/json"; }
  if (method === "POST") opts.headers["X-Probe-CSRF"] = state.config.csrf || "";  // from api/config: our origin only
  const resp = await fetch(path, opts);
  let doc;
  try { doc = await resp.json(); } catch (e) { throw new Error(`HTTP ${resp.status} from ${path}`); }
  if (doc && doc.error) throw new Error(doc.error);
  if (!resp.ok) throw new Error(`HTTP ${resp.status} from ${path}`);
  return doc;
}

const query = (sql, maxRows) => call("POST", "api/query", { sql, max_rows: maxRows });

function rowsAsObjects(res) {
  return res.rows.map(r => Object.fromEntries(res.columns.map((c, i) => [c, r[i]])));
}

function setError(panel, err) {
  $(".err", panel).textContent = err ? String(err.message || err) : "";
}

// ---------------------------------------------------------------- panels

// nan: a NaN/Inf is a value the training produced (a diverged loss) and is marked; elsewhere a non-finite
// value is one that was never measured (tokens/s of a step whose inputs were not counted) and is a gap
const METRICS = [
  { col: "loss", title: "loss", log: false, nan: true },
  { col: "grad_norm", title: "grad norm", log: false, nan: true },
  { col: "lr", title: "learning rate", log: false },
  { col: "duration", title: "step time (s)", log: false },
  { col: "tokens_per_s", title: "tokens/s", log: false, why: whyNoTokens },
  { col: "memory", title: "memory in use", log: false, bytes: true },
];

// why no step in view carries a token count, from what the steps do carry (samples: the inputs were counted)
function whyNoTokens(rows) {
  const measured = rows.filter(r => r.measured === true);
  if (measured.some(r => r.samples !== null && r.samples !== undefined)) {
    return "no token count: the model's inputs are not integer token ids (tokens are the elements of an integer " +
      "input of rank 2 or more; floats are features, not tokens); probe.step(tokens=N) gives a count";
  }
  if (measured.length) {
    return "no token count: the model's inputs were not counted on the measured steps (no model found to count " +
      "them at); probe.step(tokens=N) gives a count";
  }
  return "no step in view was measured: tokens are counted on measured steps only (PROBE_STEP_BUDGET)";
}

function buildCharts() {
  const box = $("#curves .charts");
  box.replaceChildren();
  for (const mtr of METRICS) {
    const logBox = el("input", { type: "checkbox" });
    logBox.checked = mtr.log;
    logBox.addEventListener("change", () => { mtr.log = logBox.checked; drawCurves(); });
    const chart = el("div", { class: "chart", id: "chart-" + mtr.col, "data-metric": mtr.col },
      el("div", { class: "head" }, el("b", { text: mtr.title }), el("small", { class: "count" }), el("label", {}, logBox, " log")),
      el("div", { class: "plot" }), el("div", { class: "legend" }));
    box.append(chart);
  }
}

function rankName(r) { return r === null || r === undefined ? "this process" : "rank " + r; }

const CURVE_WINDOW = 1000;  // steps kept per rank
const CURVE_OVERLAP = 8;   // recent steps asked again: loss and grad norm are read lazily and fill in late

async function refreshCurves() {
  // the first answer is the whole window; later ones only the new steps (and a short overlap)
  const since = state.curvesMax == null ? `(SELECT MAX(step) - ${CURVE_WINDOW} FROM torch.steps)` : String(state.curvesMax - CURVE_OVERLAP);
  // the latest step always comes back: below what was seen means the job started over
  const sql = "SELECT rank, step, loss, grad_norm, lr, duration, tokens_per_s, memory, measured, samples FROM torch.steps " +
              `WHERE step > ${since} OR step = (SELECT MAX(step) FROM torch.steps) ORDER BY step`;
  const res = await query(sql, 20000);
  const rows = rowsAsObjects(res);
  if (state.curvesMax != null && rows.length && Math.max(...rows.map(r => r.step)) < state.curvesMax - CURVE_OVERLAP) {
    state.curves = new Map();
    state.curvesMax = null;
    return refreshCurves();
  }
  const byRank = state.curves;
  let top = state.curvesMax;
  for (const row of rows) {
    if (!byRank.has(row.rank)) byRank.set(row.rank, new Map());
    byRank.get(row.rank).set(row.step, row);
    top = top == null ? row.step : Math.max(top, row.step);
  }
  for (const steps of byRank.values()) {
    for (const step of steps.keys()) if (step <= top - CURVE_WINDOW) steps.delete(step);
  }
  state.curves = byRank;
  state.curvesMax = top;
  drawCurves();
}

function drawCurves() {
  const ranks = [...state.curves.keys()].sort((a, b) => (a ?? -1) - (b ?? -1));
  for (const mtr of METRICS) {
    const chart = $("#chart-" + mtr.col);
    // every step in view, with null where the step does not carry the value: the chart leaves a gap there
    const series = ranks.map((r, i) => ({
      name: rankName(r), color: COLORS[i % COLORS.length],
      points: [...state.curves.get(r).values()].sort((a, b) => a.step - b.step).map(row => {
        let v = row[mtr.col] === null || row[mtr.col] === undefined ? null : num(row[mtr.col]);
        if (v !== null && !Number.isFinite(v) && !mtr.nan) v = null;
        return [row.step, v];
      }),
    }));
    lineChart($(".plot", chart), series, { log: mtr.log, bytes: mtr.bytes, xmax: state.curvesMax });
    // how many of the steps in view carry the value (all ranks together)
    const shown = series.reduce((n, s) => n + s.points.length, 0);
    const carried = series.reduce((n, s) => n + s.points.filter(p => p[1] !== null).length, 0);
    const count = $(".head .count", chart);
    count.textContent = shown ? `${carried} of ${shown} ${ranks.length > 1 ? "rank-steps" : "steps"}` : "";
    count.title = `steps in view that carry ${mtr.title}; the others are gaps (not measured or not ready yet)`;
    count.dataset.carried = String(carried);
    count.dataset.shown = String(shown);
    const legend = $(".legend", chart);
    legend.replaceChildren();
    let lastStep = null;
    series.forEach((s, i) => {
      const valued = s.points.filter(p => p[1] !== null);
      const last = valued[valued.length - 1];
      if (!last) return;
      lastStep = Math.max(lastStep ?? last[0], last[0]);
      const item = el("span", { class: "latest", "data-rank": s.name, "data-step": last[0], "data-value": String(last[1]) },
        "■ ", `${s.name}: ${mtr.bytes ? fmtBytes(last[1]) : fmt(last[1])} @ step ${last[0]}`);
      item.style.color = s.color;
      legend.append(item);
      // a metric that stopped while steps go on (no longer read, e.g. the loss not found): say so
      const steps = [...state.curves.get(ranks[i]).keys()];
      const newest = Math.max(...steps);
      const gaps = valued.slice(1).map((p, k) => p[0] - valued[k][0]).sort((a, b) => a - b);
      const usual = gaps.length ? gaps[Math.floor(gaps.length / 2)] : 1;
      if (newest - last[0] > Math.max(20, 10 * usual)) {
        legend.append(el("span", { class: "stopped", text: `no ${mtr.title} after step ${last[0]} (now ${newest})` }));
      }
    });
    if (!carried && shown && mtr.why) {
      const rows = ranks.flatMap(r => [...state.curves.get(r).values()]);
      legend.append(el("span", { class: "why", text: mtr.why(rows) }));
    }
    chart.dataset.lastStep = lastStep === null ? "" : String(lastStep);
  }
}

async function refreshJob() {
  const doc = await call("GET", "api/job");
  const box = $("#job .body");
  const idx = doc.columns.indexOf("state");
  const odd = r => ["slow", "hung", "waiting", "unreachable", "stopped"].includes(r[idx]);
  box.replaceChildren(table(doc.columns, doc.rows, {
    cell: (col, v, td, tr) => {
      if (col === "state") { td.className = "state-" + v; if (odd(doc.rows.find(r => r[idx] === v) || [])) tr.className = "odd-one"; }
      if (col === "age_s" || col === "step_time") td.textContent = v === null ? "–" : Number(v).toFixed(col === "age_s" ? 1 : 4);
      if (col === "top_frame") td.className = "mono";
    },
  }));
  const steps = doc.rows.map(r => r[doc.columns.indexOf("step")]).filter(s => s !== null);
  $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}` + (steps.length ? ` · step ${Math.max(...steps)}` : "");
}

const TIME_SQL = `SELECT
    module,
    stage,
    COUNT(*) as count,
    AVG(duration) as avg_time,
    SUM(duration) as total_time
FROM python.torch_trace
WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace)
GROUP BY module, stage
ORDER BY total_time DESC
LIMIT 10`;

async function refreshTime() {
  const res = await query(TIME_SQL);
  const rows = rowsAsObjects(res);
  const box = $("#time .body");
  if (!rows.length) { box.replaceChildren(el("p", { class: "muted", text: "no module calls traced in the last 5 steps yet" })); return; }
  const top = Math.max(...rows.map(r => num(r.total_time) || 0)) || 1;
  const bars = el("div", { class: "bars" });
  for (const r of rows) {
    const fill = el("div", { class: "fill " + (r.stage === "backward" ? "backward" : "forward") });
    fill.style.width = (100 * (num(r.total_time) || 0) / top).toFixed(1) + "%";
    const val = el("span", { class: "val", text: `${((num(r.total_time) || 0) * 1000).toFixed(2)} ms · ${((num(r.avg_time) || 0) * 1000).toFixed(2)} ms avg · ${r.count}×` });
    bars.append(el("div", { class: "bar", title: `${r.module} ${r.stage}` },
      el("span", { class: "label", text: `${r.module} · ${r.stage}` }), el("div", { class: "track" }, fill), val));
  }
  box.replaceChildren(bars);
}

async function refreshStacks() {
  const doc = await call("GET", "api/stacks");
  const box = $("#stacks .body");
  box.replaceChildren();
  doc.groups.forEach((g, i) => {
    const det = el("details", { class: "group" });
    if (i === 0) det.open = true;
    det.append(el("summary", {}, el("b", { text: `${g.label} (${g.ranks.length})` }), ": " + g.summary));
    det.append(el("ol", { start: "0" }, ...g.frames.map(f => el("li", { text: `${f.func} (${f.file}:${f.lineno})` + (f.line ? `  ${f.line}` : "") }))));
    box.append(det);
  });
  for (const f of doc.failed) box.append(el("p", { class: "state-unreachable", text: `${f.label}: unreachable: ${f.error}` }));
}

async function refreshActions() {
  const res = await query("SELECT * FROM probe.actions ORDER BY requested_at DESC LIMIT 50");
  const box = $("#actions .body");
  box.replaceChildren(res.rows.length ? table(res.columns, res.rows) : el("p", { class: "muted", text: "no actions yet" }));
}

async function refreshFindings() {
  state.findings = await call("GET", "api/findings");
  drawFindings();
}

function drawFindings() {
  const dx = state.findings;
  if (!dx) return;
  const all = $("#findings-info").checked;
  const shown = dx.findings.filter(f => all || f.severity !== "info");
  const hidden = dx.findings.length - shown.length;
  $("#findings-meta").textContent = `${dx.rules_run} rules over ${dx.answering} of ${dx.processes} process${dx.processes === 1 ? "" : "es"} in ${dx.elapsed_s} s` +
    (hidden ? ` · ${hidden} info finding${hidden === 1 ? "" : "s"} hidden` : "");
  const box = $("#findings .body");
  if (!shown.length) { box.replaceChildren(el("p", { class: "muted", text: "nothing wrong found" })); return; }
  box.replaceChildren(...shown.map(f => {
    const where = [f.rank != null ? `rank ${f.rank}` : null, f.step != null ? `step ${f.step}` : null].filter(Boolean).join(" · ");
    return el("div", { class: "finding sev-" + f.severity, "data-rule": f.rule },
      el("div", {}, el("b", { class: "sev", text: f.severity.toUpperCase() }), ` ${f.family}/${f.rule}`, where ? el("span", { class: "muted", text: `  (${where})` }) : null),
      el("div", { text: f.message }),
      ...f.next.map(n => el("div", {}, "next: ", el("code", { text: n }))));
  }));
}

const PANELS = [
  { id: "job", fn: refreshJob },
  { id: "curves", fn: refreshCurves },
  { id: "time", fn: refreshTime },
  { id: "stacks", fn: refreshStacks },
  { id: "actions", fn: refreshActions },
  // the doctor reads whole tables: every 30 s (and on its button), never in the first paint
  { id: "findings", fn: refreshFindings, period: 30, lazy: true },
];

// ---------------------------------------------------------------- schema and SQL console

async function loadSchema() {
  const doc = await call("GET", "api/tables");
  state.tables = Object.fromEntries(doc.tables.map(t => [t.name, t]));
  // a panel whose table is missing hides itself
  for (const panel of document.querySelectorAll(".panel")) {
    const need = panel.dataset.needs;
    panel.hidden = !!need && !(need in state.tables);
  }
  const box = $("#schema");
  box.replaceChildren(el("div", { class: "muted", text: `${doc.tables.length} tables (click a name to query it)` }));
  for (const t of doc.tables) {
    const name = el("span", { class: "tname", text: t.name });
    name.addEventListener("click", ev => { ev.preventDefault(); $("#sql-text").value = `SELECT * FROM ${t.name} LIMIT 100`; runSql(); });
    box.append(el("details", { title: t.description }, el("summary", {}, name),
      el("ul", {}, ...t.columns.map(c => el("li", { text: `${c.name} ${c.type}` })))));
  }
}

async function runSql() {
  const panel = $("#sql");
  const sql = $("#sql-text").value;
  $("#sql-info").textContent = "running…";
  setError(panel, null);
  try {
    const t0 = performance.now();
    const res = await query(sql, 5000);
    state.sqlResult = res;
    $("#sql-info").textContent = `${res.rows.length} row${res.rows.length === 1 ? "" : "s"}${res.truncated ? " (cut at the row cap)" : ""} in ${((performance.now() - t0) / 1000).toFixed(2)} s`;
    $("#sql-result").replaceChildren(table(res.columns, res.rows));
    const select = $("#sql-chart");
    const keep = select.value;
    select.replaceChildren(el("option", { value: "", text: "(none)" }));
    const numeric = res.columns.filter((c, i) => c !== "step" && /INT|DOUBLE|FLOAT|DECIMAL|REAL|NUMERIC/i.test(res.types[i] || ""));
    for (const c of numeric) select.append(el("option", { value: c, text: c }));
    if (res.columns.includes("step")) select.value = numeric.includes(keep) ? keep : (numeric[0] || "");
    else select.value = "";
    select.disabled = !res.columns.includes("step");
    drawSqlChart();
  } catch (err) {
    $("#sql-info").textContent = "";
    state.sqlResult = null;  // the rows shown must be the answer to the query shown
    $("#sql-result").replaceChildren();
    $("#sql-chart-box").replaceChildren();
    setError(panel, err);
  }
}

function drawSqlChart() {
  const res = state.sqlResult, col = $("#sql-chart").value, box = $("#sql-chart-box");
  if (!res || !col || !res.columns.includes("step")) { box.replaceChildren(); return; }
  const si = res.columns.indexOf("step"), ci = res.columns.indexOf(col), ri = res.columns.indexOf("rank");
  const groups = new Map();
  for (const r of res.rows) {
    if (r[si] === null || r[ci] === null) continue;
    const key = ri >= 0 ? r[ri] : null;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push([num(r[si]), num(r[ci])]);
  }
  const series = [...groups.entries()].map(([k, pts], i) => ({
    name: ri >= 0 ? rankName(k) : col, color: COLORS[i % COLORS.length], points: pts.sort((a, b) => a[0] - b[0]) }));
  lineChart(box, series, { height: 160 });
}

// ---------------------------------------------------------------- flamegraph

function drawFlame() {
  const f = state.flame;
  const box = $("#flame-box");
  if (!f) return;
  const W = Math.max(600, box.clientWidth || 900), ROW = 18;
  const focus = f.focus || f.root;
  const boxes = [];
  let maxDepth = 0;
  // ancestors of the focus stay full width, so one can click back out
  const chain = [];
  for (let n = focus; n; n = n.parent) chain.unshift(n);
  chain.forEach((n, d) => boxes.push([n, 0, W, d]));
  const walk = (node, x, w, depth) => {
    maxDepth = Math.max(maxDepth, depth);
    let cx = x;
    const kids = [...node.children.values()].sort((a, b) => a.name < b.name ? -1 : 1);
    for (const c of kids) {
      const cw = w * c.value / node.value;
      if (cw >= 0.5) { boxes.push([c, cx, cw, depth + 1]); walk(c, cx, cw, depth + 1); }
      cx += cw;
    }
  };
  walk(focus, 0, W, chain.length - 1);
  maxDepth = Math.max(maxDepth, chain.length - 1);
  const root = svg("svg", { width: W, height: (maxDepth + 1) * ROW + 4, viewBox: `0 0 ${W} ${(maxDepth + 1) * ROW + 4}` });
  const needle = ($("#flame-search").value || "").toLowerCase();
  const total = f.root.value || 1;
  for (const [node, x, w, depth] of boxes) {
    const g = svg("g", { class: "frame", "data-name": node.name });
    const rect = svg("rect", { x: x.toFixed(1), y: depth * ROW, width: Math.max(0.5, w - 0.5).toFixed(1), height: ROW - 1, fill: flameColor(node.name), rx: 2 });
    if (needle && node.name.toLowerCase().includes(needle)) rect.classList.add("match");
    g.append(rect);
    g.append(svg("title", {}, `${node.name}\n${node.value} samples, ${(100 * node.value / total).toFixed(1)} %`));
    const chars = Math.floor((w - 6) / 6.5);
    if (chars >= 3) g.append(svg("text", { x: x + 3, y: depth * ROW + 13 }, node.name.length <= chars ? node.name : node.name.slice(0, chars - 1) + "…"));
    g.addEventListener("click", () => { f.focus = node === focus ? (node.parent || f.root) : node; drawFlame(); });
    root.append(g);
  }
  box.replaceChildren(root);
}

async function runFlame() {
  const panel = $("#flame");
  const seconds = Number($("#flame-seconds").value) || 3;
  setError(panel, null);
  $("#flame-run").disabled = true;
  $("#flame-info").textContent = `sampling for ${seconds} s…`;
  try {
    const doc = await call("POST", "api/profile", { seconds });
    state.flame = { root: flameTree(doc.stacks), focus: null };
    const samples = doc.stacks.reduce((a, s) => a + s[1], 0);
    $("#flame-info").textContent = `${samples} samples, ${doc.stacks.length} distinct stacks over ${seconds} s` +
      (doc.failed.length ? ` · no answer from ${doc.failed.map(x => x.label).join(", ")}` : "");
    drawFlame();
  } catch (err) {
    $("#flame-info").textContent = "";
    setError(panel, err);
  } finally {
    $("#flame-run").disabled = false;
  }
}

// ---------------------------------------------------------------- actions (only with --allow-actions)

function buildActionButtons() {
  const acts = state.config.actions || {};
  const box = $("#action-buttons");
  if (!state.config.allow_actions) return;
  box.hidden = false;
  const add = (label, name, ask) => {
    const b = el("button", { class: "danger", text: label });
    b.addEventListener("click", async () => {
      const params = ask ? ask() : {};
      if (params === null) return;
      const what = `${name} ${Object.values(params).join(" ")}`.trim();
      if (!window.confirm(`Send \`probe ${state.config.target} ${what}\` to the job?`)) return;
      setError($("#actions"), null);
      try {
        const doc = await call("POST", "api/action", { name, params, confirmed: true });
        setError($("#actions"), doc.error ? doc.error : null);
        refreshActions().catch(() => {});
      } catch (err) { setError($("#actions"), err); }
    });
    box.append(b);
  };
  if ("cleanup" in acts) add("cleanup", "cleanup");
  if ("checkpoint" in acts) add("checkpoint…", "checkpoint", () => { const p = window.prompt("Checkpoint path (on the training host):"); return p ? { path: p } : null; });
  if ("lr" in acts) add("scale lr…", "lr", () => { const s = window.prompt("Multiply the learning rate by:", "0.5"); return s ? { scale: s } : null; });
  if ("guard" in acts) add("guard…", "guard", () => { const s = window.prompt("Arm the guard, skipping a caught step's update; triggers (nonfinite, spike=N, loss=N), or off:", "nonfinite,spike=50"); return s ? (s.trim() === "off" ? { off: true } : { on: s, skip: true }) : null; });
}

// ---------------------------------------------------------------- refresh loop

async function refreshAll(onlyLazy) {
  if (state.busy) return;
  state.busy = true;
  try {
    const now = Date.now();
    await Promise.all(PANELS.map(async p => {
      const panel = document.getElementById(p.id);
      if (panel.hidden || (onlyLazy && !p.lazy)) return;
      if (p.period) {
        if (p.lazy && !document.body.dataset.loaded) return;
        if (p.last && now - p.last < p.period * 1000) return;
        p.last = now;
      }
      try { await p.fn(); setError(panel, null); } catch (err) { setError(panel, err); }
    }));
  } finally {
    state.busy = false;
  }
}

function schedule() {
  clearTimeout(state.timer);
  if (!state.refresh) return;
  state.timer = setTimeout(async () => {
    if (!document.hidden) await refreshAll();  // a hidden tab costs the job nothing
    schedule();
  }, state.refresh * 1000);
}

async function main() {
  buildCharts();
  try {
    state.config = await call("GET", "api/config");
  } catch (err) {
    $("#updated").textContent = String(err.message || err);
    return;
  }
  $("#target").textContent = state.config.target + (state.config.multi ? " (federated)" : "");
  state.refresh = state.config.refresh;
  const sel = $("#refresh");
  if (![...sel.options].some(o => Number(o.value) === state.refresh)) sel.append(el("option", { value: String(state.refresh), text: `${state.refresh} s` }));
  sel.value = String(state.refresh);
  sel.addEventListener("change", () => { state.refresh = Number(sel.value); schedule(); });
  $("#sql-run").addEventListener("click", runSql);
  $("#sql-text").addEventListener("keydown", ev => { if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); runSql(); } });
  $("#sql-chart").addEventListener("change", drawSqlChart);
  $("#flame-run").addEventListener("click", runFlame);
  $("#flame-search").addEventListener("input", drawFlame);
  $("#findings-info").addEventListener("change", drawFindings);
  $("#findings-run").addEventListener("click", async () => {
    const b = $("#findings-run");
    b.disabled = true;
    try { await refreshFindings(); setError($("#findings"), null); } catch (err) { setError($("#findings"), err); }
    finally { b.disabled = false; }
  });
  window.addEventListener("resize", () => { drawCurves(); drawFlame(); drawSqlChart(); });
  buildActionButtons();
  try { await loadSchema(); } catch (err) { setError($("#sql"), err); }
  await refreshAll();
  document.body.dataset.loaded = "1";
  refreshAll(true).then(schedule);  // now the lazy panels (the doctor)
  setInterval(() => { if (!document.hidden) loadSchema().catch(() => {}); }, 30000);
}

main();
