// The live status page: polls /api/status once a second and redraws what changed.
// Every string from the API reaches the DOM through textContent or setAttribute, never
// innerHTML: event fields and reasons are free text and can hold markup.
"use strict";

const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 5000;
const STALE_MS = 2000;
const TOKEN_KEY = "oobleck_token";
const USUAL = new Set(["start", "process", "join", "plan", "rendezvous", "checkpoint",
  "control_plane", "finish"]);
const BAD = new Set(["failure", "lost", "abort", "hang", "worker_broken", "data_plane_hang",
  "inject_failure", "kill_requested", "fenced", "drain_refused", "checkpoint_refused",
  "checkpoint_failed"]);
const ACTIONS = {
  kill: "Kill node {n}? This sends SIGKILL to its agent and workers, like a crash; " +
    "the job detects the loss and reconfigures without it.",
  drain: "Drain node {n}? It leaves the job at the next step boundary; " +
    "the job reconfigures without it.",
};

const $ = (id) => document.getElementById(id);
const drawn = new Map(); // section name -> JSON of the data it was last drawn from
let chartsVersion = null;
let finished = false;

// el("td", {class: "num"}, "text", childNode): strings become text nodes.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined && v !== false) node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

// Calls draw(data) only when data differs from what the section shows.
function section(name, data, draw) {
  const key = JSON.stringify(data === undefined ? null : data);
  if (drawn.get(name) === key) return;
  drawn.set(name, key);
  draw(data);
}

function fmt(x, digits) {
  if (typeof x !== "number" || !Number.isFinite(x)) return "–";
  return x.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
}

function duration(s) {
  if (typeof s !== "number" || !Number.isFinite(s)) return "–";
  if (s < 60) return s.toFixed(1) + " s";
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
  const mm = String(m).padStart(2, "0"), ss = String(sec).padStart(2, "0");
  return h > 0 ? `${h}h${mm}m${ss}s` : `${m}m${ss}s`;
}

function ageText(ms) {
  if (typeof ms !== "number") return "–";
  return ms < 10000 ? `${(ms / 1000).toFixed(1)} s` : duration(ms / 1000);
}

function nodeId(entry) {
  return Array.isArray(entry) ? entry[0] : entry;
}

function setText(id, text, cls) {
  const node = $(id);
  node.textContent = text;
  if (cls !== undefined) node.className = cls;
}

// ---- header ------------------------------------------------------------------------------

// s: the status, or null when the page's own request failed (`failed` says how).
function drawConnection(s, failed) {
  $("connection").title = (s ? s.error : failed) || "";
  // What is on screen is the last answer: dim it while nothing new comes.
  document.body.classList.toggle("stale-data", !s || !s.connected);
  if (s === null) return setText("connection", "not answering", "conn conn-down");
  if (!s.connected) {
    const why = s.error ? `master not answering: ${s.error}` : "master not answering";
    return setText("connection", why, "conn conn-down");
  }
  if (s.finished) return setText("connection", "finished", "conn conn-done");
  setText("connection", "live", "conn conn-live");
}

function drawHeader(s) {
  const job = s.job || {}, latest = s.latest, cluster = s.cluster;
  setText("model", job.model || "oobleck");
  setText("run-dir", job.run_dir || "");
  document.title = `${job.model || "oobleck"} · ${s.finished ? "finished" : "training"}`;
  const step = (cluster && cluster.committed_step) ?? (latest ? latest.step : null);
  const total = job.total_steps;
  const pct = total > 0 && typeof step === "number" ? Math.min(100, 100 * step / total) : 0;
  const share = total > 0 ? ` · ${pct.toFixed(0)}%` : "";
  setText("step", `${step ?? "–"} / ${total ?? "–"}${share}`);
  $("progress-fill").style.width = pct.toFixed(1) + "%";
  document.querySelector(".progress").setAttribute("aria-valuenow", pct.toFixed(0));
  const gen = cluster ? cluster.generation : latest ? latest.generation : null;
  setText("generation", gen ?? "–");
  drawMaster(cluster);
  setText("loss", latest ? fmt(latest.loss, 4) : "–");
  setText("tokens", latest ? fmt(latest.tokens_per_s, 0) : "–");
  setText("wall", latest ? duration(latest.wall_s) : "–");
  const left = s.fault_tolerance_left;
  // The plan in force may survive more than the job's f (more pipelines than f + 1).
  setText("fault-left", `${left ?? "–"} (f = ${job.fault_threshold ?? "–"})`,
    left === 0 ? "warn" : "");
  drawNodesLive(cluster);
}

// "epoch 2 · 1 standby": the master serving the page, and who takes over if it is lost.
function drawMaster(cluster) {
  if (!cluster || !cluster.epoch) return setText("master", "–");
  const n = (cluster.standbys || []).length;
  const standbys = n === 0 ? "no standby" : n === 1 ? "1 standby" : `${n} standbys`;
  setText("master", `epoch ${cluster.epoch} · ${standbys}`);
}

function drawNodesLive(cluster) {
  if (!cluster) return setText("nodes-live", "–");
  const live = (cluster.nodes || []).filter((n) => n.last_seen_ms <= STALE_MS).length;
  setText("nodes-live", `${live} / ${cluster.expected_nodes ?? "–"}`,
    live < cluster.expected_nodes ? "warn" : "");
}

// ---- cluster map -------------------------------------------------------------------------

// node id -> ["p0 · s1", ...] from the plan's stages.
function stagesByNode(pipelines) {
  const out = new Map();
  for (const p of pipelines || []) {
    (p.stages || []).forEach((st, i) => {
      if (!out.has(st.node)) out.set(st.node, []);
      out.get(st.node).push(`p${p.id} · s${i}`);
    });
  }
  return out;
}

function health(node, cluster) {
  const id = node.node;
  const draining = (cluster.draining || []).find((d) => nodeId(d) === id);
  if (draining) return ["draining", "h-drain", Array.isArray(draining) ? draining[1] : null];
  if ((cluster.joining || []).some((j) => nodeId(j) === id)) return ["joining", "h-join"];
  if ((cluster.spare || []).some((j) => nodeId(j) === id)) return ["spare", "h-spare"];
  if (typeof node.last_seen_ms === "number" && node.last_seen_ms > STALE_MS) {
    return ["stale", "h-stale"];
  }
  return ["ok", "h-ok"];
}

// Nodes named only in joining/draining/spare still get a row.
function allNodes(cluster) {
  const rows = [...(cluster.nodes || [])];
  const known = new Set(rows.map((n) => n.node));
  for (const list of [cluster.joining, cluster.draining, cluster.spare]) {
    for (const entry of list || []) {
      const id = nodeId(entry);
      if (!known.has(id)) { known.add(id); rows.push({node: id}); }
    }
  }
  return rows.sort((a, b) => a.node - b.node);
}

function actionButton(action, id) {
  return el("button", {type: "button", class: `btn btn-${action}`, "data-action": action,
    "data-node": id, disabled: finished}, action);
}

function healthCell(label, cls, why) {
  return el("td", {class: "health"}, el("span", {class: `pill ${cls}`}, label),
    why ? el("span", {class: "why small muted", title: why}, ` ${why}`) : null);
}

function nodeRow(node, cluster, stages) {
  const [label, cls, why] = health(node, cluster);
  const where = stages.get(node.node);
  const actions = finished ? el("td", {class: "actions-col muted"}, "–")
    : el("td", {class: "actions-col"}, actionButton("drain", node.node), " ",
      actionButton("kill", node.node));
  return el("tr", {"data-node": node.node, class: cls},
    el("td", {class: "num"}, node.node),
    el("td", {class: "mono"}, node.addr ?? "–"),
    el("td", {class: "num"}, node.devices ?? "–"),
    el("td", {}, where ? where.join(", ") : "–"),
    healthCell(label, cls, why),
    el("td", {class: "num"}, ageText(node.last_seen_ms)),
    actions);
}

function drawNodes(cluster) {
  const body = $("nodes");
  if (!cluster) {
    return body.replaceChildren(el("tr", {}, el("td", {colspan: 7, class: "muted"},
      "no cluster yet")));
  }
  const stages = stagesByNode(cluster.pipelines);
  body.replaceChildren(...allNodes(cluster).map((n) => nodeRow(n, cluster, stages)));
}

// ---- plan --------------------------------------------------------------------------------

function stageBox(st, i) {
  const [a, b] = st.layers || [0, 0];
  const range = b - a > 1 ? `layers ${a}–${b - 1}` : `layer ${a}`;
  const box = el("div", {class: "stage", title: `stage ${i}: ${range}`},
    el("div", {class: "stage-head"}, `s${i}`, el("span", {class: "muted"}, ` ${range}`)),
    el("div", {class: "stage-sub"}, `node ${st.node} · ${st.devices} dev`));
  box.style.flexGrow = String(Math.max(1, b - a));
  return box;
}

function pipelineRow(p, totalMb) {
  const share = totalMb > 0 ? (100 * p.microbatches / totalMb).toFixed(1) + "%" : "–";
  return el("div", {class: "pipeline", "data-pipeline": p.id},
    el("div", {class: "pipe-label"},
      el("b", {}, `pipeline ${p.id}`),
      el("span", {class: "small muted"}, `${p.microbatches} microbatch` +
        (p.microbatches === 1 ? "" : "es") + ` · ${share} of batch`)),
    el("div", {class: "stages"}, ...(p.stages || []).map(stageBox)));
}

function drawPlan(data) {
  const [pipelines, globalBatch] = data;
  const box = $("plan");
  if (!pipelines || pipelines.length === 0) {
    setText("plan-summary", "");
    return box.replaceChildren(el("p", {class: "muted"}, "no plan yet"));
  }
  const totalMb = pipelines.reduce((s, p) => s + (p.microbatches || 0), 0);
  setText("plan-summary", `${pipelines.length} pipelines · ${totalMb} microbatches` +
    (globalBatch ? ` · global batch ${globalBatch}` : ""));
  box.replaceChildren(...pipelines.map((p) => pipelineRow(p, totalMb)));
}

// ---- charts ------------------------------------------------------------------------------

function drawCharts(version) {
  if (version === null || version === undefined || version === chartsVersion) return;
  chartsVersion = version;
  for (const img of document.querySelectorAll(".charts img")) {
    img.src = `${img.dataset.src}?v=${encodeURIComponent(version)}`;
  }
}

// ---- ranks -------------------------------------------------------------------------------

function splitBar(t, maxStep) {
  const bar = el("div", {class: "split"});
  const parts = [["fwd", t.forward_ms], ["bwd", t.backward_ms], ["p2p", t.p2p_ms],
    ["col", t.collective_ms]];
  for (const [cls, ms] of parts) {
    const seg = el("span", {class: `seg ${cls}`});
    seg.style.width = maxStep > 0 ? `${(100 * (ms || 0) / maxStep).toFixed(2)}%` : "0";
    bar.append(seg);
  }
  return bar;
}

function rankRow(r, maxStep) {
  const t = r.times || {};
  const flag = r.straggler ? el("span", {class: "flag"}, " straggler") : null;
  return el("tr", {class: r.straggler ? "straggler" : null, "data-rank": r.rank},
    el("td", {class: "num"}, r.rank, flag),
    el("td", {class: "num"}, r.node),
    el("td", {class: "num"}, fmt(t.forward_ms, 1)),
    el("td", {class: "num"}, fmt(t.backward_ms, 1)),
    el("td", {class: "num"}, fmt(t.p2p_ms, 1)),
    el("td", {class: "num"}, fmt(t.collective_ms, 1)),
    el("td", {class: "num"}, el("b", {}, fmt(t.step_ms, 1))),
    el("td", {class: "bar-col"}, splitBar(t, maxStep)));
}

function drawRanks(ranks) {
  const body = $("ranks");
  if (!ranks || ranks.length === 0) {
    return body.replaceChildren(el("tr", {}, el("td", {colspan: 8, class: "muted"},
      "no step timings yet")));
  }
  const maxStep = Math.max(...ranks.map((r) => (r.times && r.times.step_ms) || 0));
  body.replaceChildren(...ranks.map((r) => rankRow(r, maxStep)));
}

// ---- events ------------------------------------------------------------------------------

function fieldText(v) {
  if (typeof v === "number" && !Number.isInteger(v)) return String(Number(v.toPrecision(4)));
  const text = typeof v === "string" ? v : JSON.stringify(v);
  return text.length > 160 ? text.slice(0, 157) + "…" : text;
}

// The fields a reader looks for first, by kind; the rest follow in the order they came.
const FIRST = {
  reconfig: ["cause", "lost_nodes", "drained_nodes", "joined_nodes", "new_pipelines", "in_place",
    "fault_tolerance"],
  resumed: ["since_failure_s", "phases"],
  failure: ["reason"],
  checkpoint_failed: ["error", "path", "free_bytes", "needed_bytes", "filesystem", "retrying"],
  straggler: ["node", "rank", "factor", "evicted", "refusal"],
};

function ordered(e) {
  const first = FIRST[e.event] || ["node", "rank", "reason"];
  const keys = Object.keys(e).filter((k) => !["event", "step", "wall_s"].includes(k));
  return [...first.filter((k) => keys.includes(k)), ...keys.filter((k) => !first.includes(k))];
}

// Empty lists and nulls are left out; plan layouts shrink to their node lists.
function eventFields(e) {
  const out = [];
  for (const k of ordered(e)) {
    const v = e[k];
    if (v === null || (Array.isArray(v) && v.length === 0) || v === "") continue;
    if (k === "pipelines" && Array.isArray(v)) {
      out.push([k, v.map((p) => (p && p.nodes ? p.nodes : p))]);
    } else if (k === "phases" && v && typeof v === "object") {
      const parts = Object.entries(v).map(([p, t]) => `${p.replace(/_s$/, "")} ${fmt(t, 3)} s`);
      out.push([k, parts.join(", ")]);
    } else {
      out.push([k, v]);
    }
  }
  return out;
}

function eventItem(e) {
  const kind = String(e.event ?? "?");
  const cls = BAD.has(kind) ? "ev bad" : USUAL.has(kind) ? "ev" : "ev unusual";
  const fields = el("span", {class: "ev-fields"});
  for (const [k, v] of eventFields(e)) {
    fields.append(el("span", {class: "kv"}, el("span", {class: "k"}, k), " ", fieldText(v)));
  }
  return el("li", {"data-kind": kind, class: cls},
    el("span", {class: "ev-kind"}, kind),
    el("span", {class: "ev-when"},
      e.step !== undefined ? el("span", {class: "ev-step"}, `step ${e.step}`) : null,
      e.wall_s !== undefined ? el("span", {class: "ev-wall"}, duration(e.wall_s)) : null),
    fields);
}

function drawEvents(events) {
  const list = events || [];
  setText("events-count", list.length ? `${list.length}, newest first` : "");
  if (list.length === 0) {
    return $("events").replaceChildren(el("li", {class: "muted"}, "no events yet"));
  }
  $("events").replaceChildren(...list.slice().reverse().map(eventItem));
}

// ---- actions -----------------------------------------------------------------------------

function notice(text, kind) {
  const box = $("notice");
  box.hidden = false;
  box.className = `notice notice-${kind}`;
  const when = new Date().toLocaleTimeString([], {hour12: false});
  const dismiss = el("button", {type: "button", class: "btn-link", "data-dismiss": "1"}, "dismiss");
  box.replaceChildren(el("span", {class: "muted"}, `${when} `), text, " ", dismiss);
}

function authHeaders() {
  let token = null;
  try { token = sessionStorage.getItem(TOKEN_KEY); } catch (_) { /* storage disabled */ }
  return token ? {Authorization: `Bearer ${token}`} : {};
}

async function post(url) {
  const res = await fetch(url, {method: "POST", headers: authHeaders()});
  let body = {};
  try { body = await res.json(); } catch (_) { /* not JSON: keep the status */ }
  return {status: res.status, ok: res.ok, body};
}

// On 401 asks once for the job token, keeps it for this tab, and retries once.
async function act(action, node) {
  const url = `/api/nodes/${encodeURIComponent(node)}/${action}`;
  let r = await post(url);
  if (r.status === 401) {
    const token = prompt(`The job token is needed to ${action} node ${node} ` +
      "(or open the one-time link train printed):");
    if (!token) return notice(`${action} node ${node}: cancelled (no token)`, "err");
    // A header value must be printable ASCII; anything else would make every fetch throw.
    if (!/^[\x21-\x7e]+$/.test(token.trim())) {
      return notice(`${action} node ${node}: that is not a job token`, "err");
    }
    try { sessionStorage.setItem(TOKEN_KEY, token.trim()); } catch (_) { /* no storage */ }
    r = await post(url);
    if (r.status === 401) {
      try { sessionStorage.removeItem(TOKEN_KEY); } catch (_) { /* no storage */ }
    }
  }
  const text = r.body.message || r.body.error || `HTTP ${r.status}`;
  notice(`${action} node ${node}: ${text}`, r.ok ? "ok" : "err");
}

function onClick(ev) {
  const btn = ev.target.closest("button[data-action]");
  if (btn) {
    const {action, node} = btn.dataset;
    if (!ACTIONS[action] || finished) return;
    if (!confirm(ACTIONS[action].replace("{n}", node))) return;
    btn.disabled = true;
    act(action, node)
      .catch(() => notice(`${action} node ${node}: the server did not answer`, "err"))
      .finally(() => { btn.disabled = finished; });
    return;
  }
  if (ev.target.closest("button[data-dismiss]")) $("notice").hidden = true;
}

// ---- polling -----------------------------------------------------------------------------

function render(s) {
  finished = Boolean(s.finished);
  drawConnection(s);
  drawHeader(s);
  const cluster = s.cluster || null;
  section("nodes", [cluster, finished], () => drawNodes(cluster));
  section("plan", [cluster && cluster.pipelines, s.job && s.job.global_batch_size], drawPlan);
  section("ranks", cluster && cluster.ranks, drawRanks);
  section("events", s.events, drawEvents);
  $("act-hint").hidden = finished || Boolean(s.can_act);
  drawCharts(s.charts_version);
}

// Resolves to {status} or {failed: why}; never rejects.
async function fetchStatus() {
  try {
    const res = await fetch("/api/status", {headers: authHeaders(), cache: "no-store",
      signal: AbortSignal.timeout(FETCH_TIMEOUT_MS)});
    if (res.status === 401) return {failed: "HTTP 401: open the one-time link train printed"};
    if (res.status !== 200) return {failed: `HTTP ${res.status}`};
    return {status: await res.json()};
  } catch (_) {
    return {failed: "no answer"};
  }
}

// One request at a time: the next poll is scheduled when this one has finished.
async function poll() {
  const started = Date.now();
  const {status, failed} = await fetchStatus();
  try {
    if (status) render(status); else drawConnection(null, failed);
  } catch (_) {
    setText("connection", "unreadable status", "conn conn-down");
  }
  setTimeout(poll, Math.max(0, POLL_MS - (Date.now() - started)));
}

document.addEventListener("click", onClick);
poll();
