// dspark dashboard page: reads /api/v1/snapshot from the server that served it, once a second.
// No other origin, no inline script (the server's Content-Security-Policy forbids both).
"use strict";

const SNAPSHOT = "/api/v1/snapshot";
const TOKEN_KEY = "dspark-dashboard-token";
const PERIOD_MS = 1000;
const NS = "http://www.w3.org/2000/svg";

// A token in the URL fragment (#token=...) never reaches any server; keep it for this tab only.
if (location.hash.startsWith("#token=")) {
  sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(location.hash.slice(7)));
  history.replaceState(null, "", location.pathname);
}

function lookup(obj, path) {
  return path.split(".").reduce((o, k) => (o === null || o === undefined ? undefined : o[k]), obj);
}

const fmt = {
  num(x, d) { return x.toLocaleString("en-US", {minimumFractionDigits: d, maximumFractionDigits: d}); },
  int(x) { return Math.round(x).toLocaleString("en-US"); },
  pct(x) { return (x * 100).toFixed(1) + " %"; },
  secs(x) { return x < 1 ? (x * 1000).toFixed(1) + " ms" : x.toFixed(2) + " s"; },
  span(lo, hi) {  // "25.0–50.0 ms", "1.00–2.50 s": one unit, the upper bound's
    return hi < 1 ? `${(lo * 1000).toFixed(1)}–${fmt.secs(hi)}` : `${lo.toFixed(2)}–${fmt.secs(hi)}`;
  },
  gib(b) { return (b / 1073741824).toFixed(1); },
  clock(t, seconds) {  // a wall-clock time, 24 h, this browser's time zone: "14:03" or "14:03:27"
    const d = new Date(t * 1000), two = (n) => String(n).padStart(2, "0");
    return `${two(d.getHours())}:${two(d.getMinutes())}` + (seconds ? `:${two(d.getSeconds())}` : "");
  },
  dur(s) {
    if (s < 120) return s.toFixed(0) + " s";
    if (s < 7200) return (s / 60).toFixed(0) + " min";
    return (s / 3600).toFixed(1) + " h";
  },
};

function formatField(path, v) {
  if (path.includes("_tps.")) return fmt.num(v, 1);
  if (path.endsWith("per_s")) return fmt.num(v, 2);
  if (path.startsWith("vllm.finished.")) return fmt.int(v);
  if (path.startsWith("vllm.tokens.") || path.startsWith("vllm.requests.")) return fmt.int(v);
  if (path === "vllm.kv_cache_usage" || path.includes("acceptance_rate")) return fmt.pct(v);
  if (path === "vllm.latency.window_s") return fmt.int(v);
  if (path.startsWith("vllm.latency.")) return fmt.secs(v);
  if (path.endsWith("mean_acceptance_length")) return fmt.num(v, 2);
  return String(v);
}

function setText(el, text, cls) {
  if (el.textContent !== text) el.textContent = text;
  el.classList.toggle("unavailable", cls === "unavailable");
  el.classList.toggle("none", cls === "none");
}

function renderFields(snap) {
  const vllm = snap.vllm;
  for (const el of document.querySelectorAll("[data-field]")) {
    const path = el.dataset.field;
    if (!path.startsWith("vllm.")) continue;
    const v = lookup(snap, path);
    const quantile = path.match(/^vllm\.latency\.(\w+)\.(p50|p95)$/);
    if (quantile) el.title = "";
    if (path === "vllm.version") { setText(el, vllm.available && v ? v : "—", vllm.available ? undefined : "none"); continue; }
    // vLLM down: one banner says why; the cells stay quiet ("—") instead of a wall of red.
    if (!vllm.available) { setText(el, "—", "none"); continue; }
    if (path.startsWith("vllm.spec_decode.") && vllm.spec_decode === null) { setText(el, "off", "none"); continue; }
    if (v === null || v === undefined) { setText(el, "—", "none"); continue; }
    if (quantile) { showQuantile(el, vllm.latency[quantile[1]], quantile[2]); continue; }
    setText(el, formatField(path, v));
  }
  const win = document.getElementById("latency-window");
  if (!vllm.available) win.firstChild.textContent = "no data while vLLM is down ";
  else win.firstChild.textContent = "last ";
  win.querySelector("[data-field]").hidden = !vllm.available;
  win.lastChild.textContent = vllm.available ? " s" : "";
  const note = document.getElementById("idle-note");
  note.hidden = !(vllm.available && vllm.idle);
  if (!note.hidden) {
    const every = snap.liveness_interval_s ? ` every ${fmt.num(snap.liveness_interval_s, 0)} s` : "";
    setText(note, `Idle: nothing running or waiting. What still moves is the head's liveness probe, ` +
                  `a 1-token completion${every}, sent only while the engine is idle.`);
  }
  const kv = vllm.available ? vllm.kv_cache_usage : null;
  document.getElementById("kv-bar").style.width = kv === null ? "0" : Math.min(100, kv * 100).toFixed(1) + "%";
}

// A percentile comes from vLLM's histogram buckets, never from the requests themselves: shown as
// one figure only where the proven range (the bucket narrowed by the exact sum) is within 10 %;
// otherwise as that range ("≤ 44.2 ms", "25.0–50.0 ms"). A median above the mean is shown only
// when its whole range is, and marked "*" (the note under the table says why).
function showQuantile(el, lat, q) {
  const v = lat[q], [lo, hi] = lat[q + "_range"], [a, b] = lat[q + "_bucket"];
  let text;
  if (lat.count === 1 || (hi !== null && hi - lo <= 0.1 * hi)) text = fmt.secs(v);
  else if (hi === null) text = "> " + fmt.secs(lo);
  else if (lo <= 0.1 * hi) text = "≤ " + fmt.secs(hi);
  else text = fmt.span(lo, hi);
  const above = q === "p50" && lo > lat.window_mean;
  setText(el, above ? text + " *" : text);
  el.title = lat.count === 1 ? "one request in the window: its own value" :
    `from vLLM's histogram bucket ${b === null ? "> " + fmt.secs(a) : fmt.span(a, b)}` +
    (b === null ? "" : ` (width ${fmt.secs(b - a)})`) + `, ${lat.count} requests; ` +
    `with their exact mean, the ${q} lies in ${hi === null ? "> " + fmt.secs(lo) : fmt.span(lo, hi)}; ` +
    `estimate ${fmt.secs(v)}` + (above ? "; above the mean: a few much faster requests pull the mean down" : "");
}

function na(x, f) { return x === null || x === undefined ? "n/a" : f(x); }

// Only the head runs liveness rounds (dspark.node.liveness): a worker has no proof of its own.
const WORKER_LIVENESS = "Only the head checks liveness: one vLLM engine spans every rank, so the head's " +
  "proof of life (progress, or a 1-token probe while idle) covers this worker too; a dead or wedged " +
  "worker stalls the engine and fails the head's check.";

function nodeCard(n) {
  const card = document.createElement("div");
  card.className = "node";
  card.dataset.node = n.name;
  const h = document.createElement("h3");
  h.textContent = n.name;
  // the state and the node's place in the pair share one line, so neither wraps in a narrow card
  const row = document.createElement("div");
  row.className = "staterow";
  const state = document.createElement("span");
  state.className = "state";
  state.dataset.field = "state";
  const sub = document.createElement("small");
  sub.textContent = `rank ${n.rank} · ${n.role}`;
  row.append(state, sub);
  const detail = document.createElement("div");
  detail.className = "detail";
  detail.dataset.field = "detail";
  // a node on another runtime line than the head's says so here (a wrapping line, in the warning colour)
  const lineNote = document.createElement("div");
  lineNote.className = "linenote";
  lineNote.dataset.field = "linenote";
  lineNote.hidden = true;
  const table = document.createElement("table");
  for (const [key, label] of [["runtime_line", "runtime line"],
                              ["restarts", "restarts"], ["vllm_pid", "vLLM pid"], ["uptime", "uptime"],
                              ["liveness", "alive by"],
                              ["gpu_temp", "GPU temperature"], ["gpu_power", "GPU power"],
                              ["gpu_util", "GPU utilization"], ["nvme_temp", "NVMe temperature"],
                              ["mem_used", "memory used"], ["mem_free", "memory available"]]) {
    const tr = table.insertRow();
    tr.insertCell().textContent = label;
    const td = tr.insertCell();
    td.className = "v";
    td.dataset.field = key;
  }
  // the node's memory in use (on a GB10 the unified memory the GPU shares), as a bar under the figures
  const bar = document.createElement("div");
  bar.className = "bar mem";
  bar.append(document.createElement("div"));
  card.append(h, row, detail, lineNote, table, bar);
  return card;
}

// The pair's runtime line: the head's line in the header, and a strip while the head's
// state names a switch (or its rollback) under way.
const NO_LINE = {head: null, mixed: false, switch: null};

function renderLine(snap) {
  const rl = snap.runtime_line || NO_LINE;
  setText(document.getElementById("line"), rl.head || "—", rl.head ? undefined : "none");
  const strip = document.getElementById("switch");
  const sw = rl.switch;
  strip.hidden = !sw;
  if (!sw) return;
  const since = sw.for_s === null ? "" : `, ${fmt.dur(sw.for_s)} so far`;
  setText(strip, `${sw.rollback ? "rolling back" : "switching"} ${sw.from} → ${sw.to} · runtime line ` +
    (sw.rollback ? "rollback" : "switch") + (sw.id ? ` ${sw.id}` : "") + since +
    (sw.rollback ? `; it ends once every node serves ${sw.to} again`
                 : `; it ends once every node serves ${sw.to} and the verdict is in`));
}

function renderNodes(snap) {
  const rl = snap.runtime_line || NO_LINE;
  const box = document.getElementById("nodes");
  const many = snap.nodes.length > 2;
  box.classList.toggle("many", many);
  box.closest(".panel").classList.toggle("many", many);
  for (const n of snap.nodes) {
    let card = box.querySelector(`.node[data-node="${CSS.escape(n.name)}"]`);
    if (!card) { card = nodeCard(n); box.append(card); }
    const st = card.querySelector('[data-field="state"]');
    setText(st, n.state);
    st.className = "state state-" + n.state;
    card.classList.toggle("bad", ["failed", "unreachable", "stopped", "stopping"].includes(n.state));
    setText(card.querySelector('[data-field="detail"]'), n.detail || "");
    const gpu = (n.hardware.gpus || [])[0] || {};
    const values = !n.reachable ? Object.fromEntries(  // the last answer's figures are stale
      ["runtime_line", "restarts", "vllm_pid", "uptime", "liveness", "gpu_temp", "gpu_power", "gpu_util", "nvme_temp",
       "mem_used", "mem_free"].map((k) => [k, "—"])) : {
      runtime_line: na(n.runtime_line, String),
      restarts: na(n.restarts, fmt.int),
      vllm_pid: na(n.vllm_pid, String),
      uptime: na(n.uptime_s, fmt.dur),
      liveness: n.role !== "head" ? "via the head"
        : n.liveness && n.liveness.proof && n.liveness.proof_age_s !== null
          ? `${n.liveness.proof}, ${fmt.dur(n.liveness.proof_age_s)} ago` : "n/a",
      gpu_temp: na(gpu.temperature_c, (x) => x.toFixed(0) + " °C"),
      gpu_power: na(gpu.power_w, (x) => x.toFixed(1) + " W"),
      gpu_util: na(gpu.utilization_pct, (x) => x.toFixed(0) + " %"),
      nvme_temp: na(n.hardware.nvme_temperature_c, (x) => x.toFixed(0) + " °C"),
      mem_used: na(n.memory, (m) => `${fmt.gib(m.used_bytes)} of ${fmt.gib(m.total_bytes)} GiB`),
      mem_free: na(n.memory, (m) => `${fmt.gib(m.available_bytes)} GiB`),
    };
    for (const [k, text] of Object.entries(values)) {
      setText(card.querySelector(`[data-field="${k}"]`), text, text === "n/a" || text === "—" ? "none" : undefined);
    }
    card.querySelector('[data-field="liveness"]').title = n.role === "head" ? "" : WORKER_LIVENESS;
    const mem = n.reachable ? n.memory : null;
    const memTitle = !mem ? "" : (mem.source === "nvml" ? "NVML's memory figures for the GPU"
      : "the kernel's /proc/meminfo (MemTotal, MemAvailable)") + "; on a GB10 the unified memory CPU and GPU share";
    for (const k of ["mem_used", "mem_free"]) card.querySelector(`[data-field="${k}"]`).title = memTitle;
    card.querySelector(".bar.mem > div").style.width =
      mem ? Math.min(100, (100 * mem.used_bytes) / mem.total_bytes).toFixed(1) + "%" : "0";
    const other = n.other_line === true;
    card.classList.toggle("otherline", other);
    const lineCell = card.querySelector('[data-field="runtime_line"]');
    lineCell.classList.toggle("warnv", other);
    lineCell.title = n.runtime_line && n.file_line && n.runtime_line !== n.file_line
      ? `the cluster file names ${n.file_line}; dspark switch moved the pair to ${n.runtime_line}` : "";
    const note = card.querySelector('[data-field="linenote"]');
    note.hidden = !other;
    setText(note, !other ? "" : `on runtime line ${n.runtime_line}, the head on ${rl.head}: ` +
      (rl.switch ? "it follows the head's switch" : "a pair does not form on two lines"));
  }
}

function segments(ts, ys, x, y) {
  // one polyline per run of known values: a gap (vLLM unavailable) stays a gap
  const out = [];
  let cur = [];
  ys.forEach((v, i) => {
    if (v === null) { if (cur.length) out.push(cur); cur = []; return; }
    cur.push(`${x(ts[i]).toFixed(1)},${y(v).toFixed(1)}`);
  });
  if (cur.length) out.push(cur);
  return out;
}

// The time axis every chart shares: ticks at whole wall-clock minutes (half minutes for spans of
// two minutes or less), each labelled with its time, and "now" at the right.
function timeTicks(now, spanS) {
  const step = spanS <= 120 ? 30 : spanS <= 900 ? 60 : spanS <= 3600 ? 300 : 900;
  const out = [];
  for (let t = Math.floor(now / step) * step; t > now - spanS && out.length < 64; t -= step) {
    const x = 1 - (now - t) / spanS;
    out.push({t, x, label: fmt.clock(t, step < 60), edge: x < 0.06 || x > 0.9});
  }
  return out.reverse();
}

function drawXAxis(id, ticks) {
  const axis = document.getElementById(id);
  while (axis.firstChild) axis.firstChild.remove();
  for (const tk of ticks) {
    if (tk.edge) continue;  // too close to an edge for its label (or to "now")
    const s = document.createElement("span");
    s.textContent = tk.label;
    s.style.left = (tk.x * 100).toFixed(2) + "%";
    axis.append(s);
  }
  const now = document.createElement("span");
  now.className = "now";
  now.textContent = "now";
  axis.append(now);
}

function svgEl(name, attrs) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function drawGrid(svg, W, H, ticks) {
  while (svg.firstChild) svg.firstChild.remove();
  for (let i = 1; i < 4; i++) svg.append(svgEl("line", {x1: 0, x2: W, y1: (H * i) / 4, y2: (H * i) / 4, class: "grid"}));
  for (const tk of ticks) svg.append(svgEl("line", {x1: tk.x * W, x2: tk.x * W, y1: 0, y2: H, class: "tick"}));
}

function axisOf(snap) {
  const h = snap.history;
  const spanS = h.capacity * snap.interval_s;
  const now = h.t.length ? h.t[h.t.length - 1] : snap.generated_at;
  return {spanS, now, ticks: timeTicks(now, spanS)};
}

function renderChart(snap) {
  const svg = document.getElementById("chart");
  const h = snap.history;
  const W = 600, H = 170, P = 4;
  const {spanS, now, ticks} = axisOf(snap);
  drawGrid(svg, W, H, ticks);
  drawXAxis("x-chart", ticks);
  // decode and prefill each on their own scale (left and right): a prefill burst of thousands
  // of tok/s must not flatten the decode line.
  const top = (key) => niceMax(Math.max(0, ...h[key].filter((v) => v !== null)));
  const tops = {decode_tps: top("decode_tps"), prefill_tps: top("prefill_tps")};
  const x = (t) => W - ((now - t) / spanS) * W;
  const yOf = (max) => (v) => H - P - (v / max) * (H - 2 * P);
  for (const [key, cls] of [["prefill_tps", "prefill"], ["decode_tps", "decode"]]) {
    for (const seg of segments(h.t, h[key], x, yOf(tops[key]))) {
      const pl = document.createElementNS(NS, "polyline");
      pl.setAttribute("points", seg.length === 1 ? `${seg[0]} ${seg[0]}` : seg.join(" "));
      pl.setAttribute("class", "line " + cls);
      svg.append(pl);
    }
  }
  for (const [key, id] of [["decode_tps", "y-decode"], ["prefill_tps", "y-prefill"]]) {
    const labels = document.getElementById(id).children;
    const label = (v) => (v >= 10 ? fmt.int(v) : fmt.num(v, Number.isInteger(v) ? 0 : 1));
    labels[0].textContent = label(tops[key]);
    labels[1].textContent = label(tops[key] / 2);
  }
  const peak = (key) => Math.max(0, ...h[key].filter((v) => v !== null));
  document.getElementById("chart-max").textContent =
    `last ${fmt.dur(spanS)}: peak decode ${fmt.num(peak("decode_tps"), 1)} · prefill ${fmt.num(peak("prefill_tps"), 1)} tok/s`;
}

// One small history chart (130 units high): lines, bars and bands on one left scale.
const SMALL_H = 130, SMALL_P = 4;

function smallChart(snap, id, axisId) {
  const svg = document.getElementById(id);
  const {spanS, now, ticks} = axisOf(snap);
  drawGrid(svg, 600, SMALL_H, ticks);
  drawXAxis(axisId, ticks);
  return {svg, x: (t) => 600 - ((now - t) / spanS) * 600,
          y: (max) => (v) => SMALL_H - SMALL_P - (Math.min(v, max) / max) * (SMALL_H - 2 * SMALL_P)};
}

function drawLines(c, ts, series, max) {
  for (const [values, cls] of series) {
    for (const seg of segments(ts, values, c.x, c.y(max))) {
      c.svg.append(svgEl("polyline", {points: seg.length === 1 ? `${seg[0]} ${seg[0]}` : seg.join(" "),
                                      class: "line " + cls}));
    }
  }
}

function setYAxis(id, labels) {
  const el = document.getElementById(id).children;
  labels.forEach((t, i) => { if (el[i].textContent !== t) el[i].textContent = t; });
}

const finite = (xs) => xs.filter((v) => v !== null && v !== undefined);
const plain = (v) => (v >= 10 ? fmt.int(v) : fmt.num(v, Number.isInteger(v) ? 0 : 1));
let latencyShown = "ttft_s";

// The p50 and p95 of one latency over the trailing window, each as the band its range spans: a
// high of null (the buckets bound it only from below) leaves the band open to the top.
function renderLatencyChart(snap) {
  const h = snap.history, lat = h.latency[latencyShown];
  const c = smallChart(snap, "chart-latency", "x-latency");
  const max = Math.max(0, ...finite(lat.p95_high), ...finite(lat.p95_low), ...finite(lat.p50_high));
  const top = max > 0 ? niceSeconds(max) : 0.1;
  const y = c.y(top);
  for (const q of ["p95", "p50"]) {
    const low = lat[q + "_low"], high = lat[q + "_high"];
    let run = [];
    const flush = () => {
      if (!run.length) return;
      const pts = run.map((i) => `${c.x(h.t[i]).toFixed(1)},${y(low[i]).toFixed(1)}`);
      const back = run.slice().reverse().map((i) => `${c.x(h.t[i]).toFixed(1)},${y(high[i] === null ? top : high[i]).toFixed(1)}`);
      if (run.length === 1) {  // one point: a sliver, so that it shows
        const [x0] = pts[0].split(",");
        pts.push(`${(Number(x0) + 2).toFixed(1)},${y(low[run[0]]).toFixed(1)}`);
        back.unshift(`${(Number(x0) + 2).toFixed(1)},${y(high[run[0]] === null ? top : high[run[0]]).toFixed(1)}`);
      }
      c.svg.append(svgEl("polygon", {points: pts.concat(back).join(" "), class: "band " + q}));
      run = [];
    };
    low.forEach((v, i) => { if (v === null) flush(); else run.push(i); });
    flush();
  }
  setYAxis("y-latency", [fmt.secs(top), fmt.secs(top / 2), "0"]);
}

function niceSeconds(v) {
  // 1, 2 or 5 times a power of ten seconds, at least v
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function renderQueueChart(snap) {
  const h = snap.history;
  const c = smallChart(snap, "chart-queue", "x-queue");
  const top = niceMax(Math.max(0, ...finite(h.running), ...finite(h.waiting)));
  drawLines(c, h.t, [[h.waiting, "waiting"], [h.running, "running"]], top);
  setYAxis("y-queue", [plain(top), plain(top / 2), "0"]);
}

function renderKvChart(snap) {
  const h = snap.history;
  const c = smallChart(snap, "chart-kv", "x-kv");
  drawLines(c, h.t, [[h.kv_cache_usage, "kv"]], 1);
}

// Finished requests per second as a line; errors and aborts in each poll as bars on the same
// scale (per second of that poll), so that one failed request stands out beside the rate.
function renderRateChart(snap) {
  const h = snap.history, dt = snap.interval_s;
  const c = smallChart(snap, "chart-rate", "x-rate");
  const perS = (xs) => xs.map((v) => (v === null ? null : v / dt));
  const errors = perS(h.errors), aborts = perS(h.aborts);
  const top = niceMax(Math.max(0, ...finite(h.requests_per_s), ...finite(errors), ...finite(aborts)));
  const y = c.y(top), w = Math.max(2, (600 * dt) / (h.capacity * dt));
  for (const [xs, cls] of [[aborts, "bar-aborts"], [errors, "bar-errors"]]) {
    xs.forEach((v, i) => {
      if (!v) return;
      c.svg.append(svgEl("rect", {x: (c.x(h.t[i]) - w).toFixed(1), width: w.toFixed(1), y: y(v).toFixed(1),
                                  height: (SMALL_H - SMALL_P - y(v)).toFixed(1), class: cls}));
    });
  }
  drawLines(c, h.t, [[h.requests_per_s, "rate"]], top);
  setYAxis("y-rate", [plain(top), plain(top / 2), "0"]);
}

// The timeline: one row per node on the charts' time axis (a mark per event), and the list of
// events, newest first, with what each node's supervisor said.
const EVENT_ROW = 16;

function eventClass(e) {
  return "kind-" + e.kind + (e.kind === "liveness" && e.detail.startsWith("not alive") ? " notalive" : "");
}

function renderEvents(snap) {
  const svg = document.getElementById("chart-events");
  const names = snap.nodes.map((n) => n.name);
  const H = Math.max(1, names.length) * EVENT_ROW + 8;
  svg.setAttribute("viewBox", `0 0 600 ${H}`);
  svg.style.height = H + "px";
  const {spanS, now, ticks} = axisOf(snap);
  drawGrid(svg, 600, H, ticks);
  drawXAxis("x-events", ticks);
  const yaxis = document.getElementById("y-events");
  yaxis.style.height = H + "px";
  if (yaxis.childElementCount !== names.length || names.some((n, i) => yaxis.children[i].textContent !== n)) {
    while (yaxis.firstChild) yaxis.firstChild.remove();
    for (const n of names) { const s = document.createElement("span"); s.textContent = n; yaxis.append(s); }
  }
  for (const e of snap.events || []) {
    const row = names.indexOf(e.node);
    if (row < 0 || e.at < now - spanS || e.at > now + 5) continue;
    const x = (600 - ((now - Math.min(e.at, now)) / spanS) * 600).toFixed(1), y0 = 4 + row * EVENT_ROW;
    const mark = svgEl("line", {x1: x, x2: x, y1: y0 + 2, y2: y0 + EVENT_ROW - 2, class: "mark " + eventClass(e)});
    const title = document.createElementNS(NS, "title");
    title.textContent = `${fmt.clock(e.at, true)} ${e.node} ${e.kind}: ${e.detail}`;
    mark.append(title);
    svg.append(mark);
  }
  const list = document.getElementById("events");
  const shown = (snap.events || []).slice(-40).reverse();
  const key = shown.map((e) => `${e.at}|${e.node}|${e.kind}|${e.detail}`).join("\n");
  if (list.dataset.key === key) return;
  list.dataset.key = key;
  while (list.firstChild) list.firstChild.remove();
  if (!shown.length) {
    const li = document.createElement("li");
    li.className = "empty";
    li.textContent = "no events yet";
    list.append(li);
  }
  for (const e of shown) {
    const li = document.createElement("li");
    li.className = "event " + eventClass(e);
    li.dataset.kind = e.kind;
    li.dataset.node = e.node;
    const old = snap.generated_at - e.at > 86400;
    const cells = [["evtime", (old ? new Date(e.at * 1000).toLocaleDateString("en-CA") + " " : "") + fmt.clock(e.at, true)],
                   ["evnode", e.node], ["evkind", e.kind], ["evdetail", e.detail + (e.by === "dashboard" ? " (seen by the dashboard)" : "")]];
    for (const [cls, text] of cells) {
      const s = document.createElement("span");
      s.className = cls;
      s.textContent = text;
      li.append(s);
    }
    list.append(li);
  }
}

function niceMax(v) {
  // the axis top: 1, 2 or 5 times a power of ten, at least the largest value (and at least 1)
  if (!(v > 1)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function render(snap) {
  document.getElementById("model").textContent = snap.model || "—";
  const pair = document.getElementById("pair");
  pair.textContent = snap.serving ? "SERVING" : "NOT SERVING";
  pair.className = "badge " + (snap.serving ? "ok" : "bad");
  const banner = document.getElementById("banner");
  if (!snap.vllm.available) {
    banner.hidden = false;
    banner.textContent = "vLLM metrics unavailable: " + (snap.vllm.error || "no answer");
  } else {
    banner.hidden = true;
  }
  renderFields(snap);
  renderLine(snap);
  renderNodes(snap);
  renderChart(snap);
  renderLatencyChart(snap);
  renderQueueChart(snap);
  renderKvChart(snap);
  renderRateChart(snap);
  renderEvents(snap);
  lastSnap = snap;
  document.getElementById("updated").textContent = new Date(snap.generated_at * 1000).toLocaleTimeString();
  document.body.dataset.round = snap.round;
}

let lastSnap = null;

function askToken() {
  const form = document.getElementById("token-form");
  form.hidden = false;
  document.getElementById("token-input").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("token-form").addEventListener("submit", (e) => {
    e.preventDefault();  // never a request with the token in its URL
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token-input").value.trim());
    document.getElementById("token-form").hidden = true;
  });
  // the latency chart's tabs: which latency the bands show
  for (const b of document.querySelectorAll("#lat-tabs button")) {
    b.addEventListener("click", () => {
      latencyShown = b.dataset.lat;
      for (const o of document.querySelectorAll("#lat-tabs button")) o.classList.toggle("on", o === b);
      if (lastSnap) renderLatencyChart(lastSnap);
    });
  }
  poll();
});

async function poll() {
  const conn = document.getElementById("conn");
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 3000);
  try {
    const headers = {};
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = "Bearer " + token;
    const r = await fetch(SNAPSHOT, {headers, cache: "no-store", signal: ctl.signal});
    if (r.status === 401) {
      conn.textContent = "access token required";
      askToken();
    } else if (!r.ok) {
      conn.textContent = "dashboard answered HTTP " + r.status;
    } else {
      render(await r.json());
      conn.textContent = "";
      document.body.classList.remove("stale");
    }
  } catch (e) {
    conn.textContent = "dashboard unreachable";
    document.body.classList.add("stale");
  } finally {
    clearTimeout(timer);
    setTimeout(poll, PERIOD_MS);
  }
}
