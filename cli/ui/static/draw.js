// probe ui: drawing helpers (DOM, number formats, SVG line charts, flamegraph trees).
// Hand-written, no dependencies; loaded before app.js, which holds the panels and their state.
"use strict";

const $ = (sel, root) => (root || document).querySelector(sel);
const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac", "#eeca3b"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

// JSON has no NaN/Infinity: the server sends them as strings.
function num(v) {
  if (typeof v === "number") return v;
  if (v === "NaN") return NaN;
  if (v === "Infinity") return Infinity;
  if (v === "-Infinity") return -Infinity;
  return null;
}

function fmt(v) {
  v = num(v);
  if (v === null) return "–";
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(3);
  if (Number.isInteger(v)) return String(v);
  return v.toPrecision(5).replace(/\.?0+$/, "");
}

function ticks(values) {
  // short labels for one axis, in one format for all of them: exponents when its largest value is below 0.01 or
  // 1e5 and up, else plain decimals with the fewest digits that keep neighbouring labels apart
  const finite = values.filter(Number.isFinite);
  const big = Math.max(0, ...finite.map(Math.abs));
  if (big === 0) return values.map(() => "0");
  if (big >= 1e5 || big < 1e-2) {
    for (let d = 1; d <= 6; d++) {
      const out = values.map(v => (v === 0 ? "0" : v.toExponential(d)));
      if (new Set(out).size === out.length || d === 6) return out;
    }
  }
  const gap = Math.min(...finite.slice(1).map((v, i) => Math.abs(v - finite[i])).filter(g => g > 0), big);
  for (let d = 0; d <= 10; d++) {
    const out = values.map(v => v.toFixed(d));
    if (new Set(out).size === out.length && out.every((t, i) => Math.abs(Number(t) - values[i]) <= gap * 0.1)) {
      return out.map(t => (Number(t) === 0 ? "0" : t));
    }
  }
  return values.map(v => String(v));
}

function fmtBytes(v) {
  v = num(v);
  if (v === null || !Number.isFinite(v)) return fmt(v);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return v.toFixed(v < 10 && i ? 2 : 1).replace(/\.0+$/, "") + " " + units[i];
}

function table(columns, rows, opts) {
  opts = opts || {};
  const t = el("table");
  t.append(el("thead", {}, el("tr", {}, ...columns.map(c => el("th", { text: c })))));
  const tb = el("tbody");
  for (const r of rows) {
    const tr = el("tr");
    r.forEach((v, i) => {
      const n = num(v);
      const td = el("td", { class: n !== null ? "num" : "" , text: v === null ? "NULL" : (n !== null ? fmt(v) : String(v)) });
      if (opts.cell) opts.cell(columns[i], v, td, tr);
      tr.append(td);
    });
    tb.append(tr);
  }
  t.append(tb);
  return t;
}

// ---------------------------------------------------------------- line charts

function lineChart(box, series, opts) {
  // series: [{name, color, points: [[x, y], ...]}] in x order; y may be NaN/Infinity (marked, not drawn) or
  // null (no value at x: a gap). A line joins only neighbouring points that both have a value, so it never
  // bridges missing ones; a point with no valued neighbour is drawn as a dot.
  const W = Math.max(300, box.clientWidth || 360), H = opts.height || 150;
  const m = { l: 58, r: 10, t: 10, b: 18 };
  const log = !!opts.log;
  let xmin = Infinity, xmax = -Infinity, ymin = Infinity, ymax = -Infinity;
  const bad = [];
  for (const s of series) for (const [x, y] of s.points) {
    xmin = Math.min(xmin, x); xmax = Math.max(xmax, x);
    if (y === null) continue;
    if (!Number.isFinite(y)) { bad.push([x, y, s]); continue; }
    if (log && y <= 0) continue;
    const v = log ? Math.log10(y) : y;
    ymin = Math.min(ymin, v); ymax = Math.max(ymax, v);
  }
  if (opts.xmax != null && Number.isFinite(xmin)) xmax = Math.max(xmax, opts.xmax);  // a stopped metric shows its gap
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "linechart" });
  box.replaceChildren(root);
  if (!Number.isFinite(xmin)) { root.append(svg("text", { x: m.l, y: H / 2 }, "no data yet")); return; }
  if (!Number.isFinite(ymin)) { ymin = 0; ymax = 1; }
  if (ymin === ymax) { const d = Math.abs(ymin) * 0.1 || 1; ymin -= d; ymax += d; }  // a flat line sits mid-chart
  if (xmin === xmax) { xmax = xmin + 1; }
  const pad = (ymax - ymin) * 0.05;
  ymin = (!log && ymin >= 0 && ymin - pad < 0) ? 0 : ymin - pad;
  ymax += pad;
  const X = x => m.l + (x - xmin) / (xmax - xmin) * (W - m.l - m.r);
  const Y = v => m.t + (1 - (v - ymin) / (ymax - ymin)) * (H - m.t - m.b);
  const levels = [0, 1, 2, 3].map(i => ymin + (ymax - ymin) * i / 3);
  const labels = opts.bytes && !log ? levels.map(fmtBytes) : ticks(levels.map(v => (log ? Math.pow(10, v) : v)));
  levels.forEach((v, i) => {
    const y = Y(v);
    root.append(svg("line", { x1: m.l, x2: W - m.r, y1: y, y2: y, class: "grid" }));
    root.append(svg("text", { x: m.l - 4, y: y + 3, "text-anchor": "end", class: "tick" }, labels[i]));
  });
  root.append(svg("line", { x1: m.l, x2: m.l, y1: m.t, y2: H - m.b, class: "axis" }));
  [[xmin, "start"], [Math.round((xmin + xmax) / 2), "middle"], [xmax, "end"]].forEach(([x, anchor]) => {
    root.append(svg("text", { x: X(x), y: H - 4, "text-anchor": anchor }, String(x)));
  });
  const drawable = y => y !== null && Number.isFinite(y) && !(log && y <= 0);
  for (const s of series) {
    let d = "", pen = false, vertices = 0;
    const pts = s.points, dots = [];
    pts.forEach(([x, y], k) => {
      if (!drawable(y)) { pen = false; return; }
      const px = X(x).toFixed(1), py = Y(log ? Math.log10(y) : y).toFixed(1);
      d += (pen ? "L" : "M") + px + " " + py;
      vertices++;
      const next = pts[k + 1];
      if (!pen && !(next && drawable(next[1]))) dots.push([px, py]);  // alone between gaps: a dot
      pen = true;
    });
    root.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.5, "data-series": s.name,
                              "data-points": String(vertices) }));
    for (const [px, py] of dots) root.append(svg("circle", { cx: px, cy: py, r: 2, fill: s.color, "data-series": s.name }));
  }
  for (const [x, y, s] of bad) {
    const px = X(x);
    const tri = svg("path", { d: `M${px - 4} ${m.t + 7}L${px + 4} ${m.t + 7}L${px} ${m.t}Z`, class: "nan" });
    tri.append(svg("title", {}, `${s.name}: ${y} at step ${x}`));
    root.append(tri);
  }
  const cursor = svg("line", { y1: m.t, y2: H - m.b, class: "cursor", visibility: "hidden" });
  root.append(cursor);
  root.addEventListener("mousemove", ev => {
    const r = root.getBoundingClientRect();
    const x = xmin + (ev.clientX - r.left - m.l) / (W - m.l - m.r) * (xmax - xmin);
    const parts = [];
    let at = null;
    for (const s of series) {
      let best = null;
      for (const p of s.points) if (p[1] !== null && (best === null || Math.abs(p[0] - x) < Math.abs(best[0] - x))) best = p;
      if (best) { at = best[0]; parts.push(`${s.name}: ${opts.bytes ? fmtBytes(best[1]) : fmt(best[1])} @ step ${best[0]}`); }
    }
    if (at === null) return;
    cursor.setAttribute("x1", X(at)); cursor.setAttribute("x2", X(at)); cursor.setAttribute("visibility", "visible");
    showTip(ev, parts.join("\n"));
  });
  root.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); hideTip(); });
}

function showTip(ev, text) {
  const tip = $("#tip");
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = (ev.clientX + 12) + "px";
  tip.style.top = (ev.clientY + 12) + "px";
  tip.style.whiteSpace = "pre";
}
function hideTip() { $("#tip").hidden = true; }

// ---------------------------------------------------------------- flamegraph trees

function flameTree(stacks) {
  const root = { name: "all", value: 0, children: new Map() };
  for (const [stack, n] of stacks) {
    root.value += n;
    let node = root;
    for (const f of stack.split(";")) {
      if (!node.children.has(f)) node.children.set(f, { name: f, value: 0, children: new Map(), parent: node });
      node = node.children.get(f);
      node.value += n;
    }
  }
  return root;
}

function flameColor(name) {
  if (name.startsWith("thread ") || name.startsWith("rank ") || name.startsWith("pid ") || name === "all") return "#c9ccd3";
  let h = 0;
  for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) & 0xffff;
  return `rgb(${205 + h % 50},${90 + (h >> 4) % 110},${40 + (h >> 8) % 40})`;
}
