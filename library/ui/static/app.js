// sdtk UI: pages over the JSON API only (docs/UI.md). No framework, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") e.textContent = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
};
const DATASET_TABLES = ["general", "datasets"];
let schema = null, byName = {}, lastCheck = null, events = null, runTimer = null;

async function api(method, path, body) {
  const opts = { method, headers: {}, credentials: "same-origin" };
  if (body !== undefined) { opts.headers["content-type"] = "application/json"; opts.body = JSON.stringify(body); }
  const r = await fetch(path, opts);
  if (r.status === 401 && path !== "/api/login") { showLogin(); throw new Error("login required"); }
  const type = r.headers.get("content-type") || "";
  const data = type.includes("json") ? await r.json() : await r.text();
  return { status: r.status, data };
}

function showLogin() {
  document.querySelectorAll(".page").forEach((p) => (p.hidden = true));
  $("login").hidden = false;
}
$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const r = await api("POST", "/api/login", { token: $("login-token").value });
  if (r.status === 200) { $("login").hidden = true; init(); } else $("login-error").textContent = r.data.error;
});

// ---- TOML <-> form: the TOML text is the source of truth; the form edits its top-level lines ----
const KEY_LINE = /^\s*([A-Za-z0-9_]+)\s*=\s*(.*?)\s*$/;
const HEADER = /^\s*\[\[?\s*([^\]]+?)\s*\]\]?/;

function tomlKeys(text) {
  // {key: {value (raw text), line}} of every key outside [general] / [[datasets]] tables
  const out = {}; let table = null;
  text.split("\n").forEach((line, i) => {
    const h = line.match(HEADER);
    if (h) { table = h[1].split(".")[0]; return; }
    if (DATASET_TABLES.includes(table)) return;
    const m = line.match(KEY_LINE);
    if (m && !line.trim().startsWith("#")) out[m[1]] = { raw: m[2], line: i };
  });
  return out;
}

function tomlValue(opt, v) {
  if (opt.type === "bool") return v ? "true" : "false";
  if ((opt.type === "int" || opt.type === "float") && v.trim() !== "" && !isNaN(Number(v))) return v.trim();
  if (["path_list", "str_list", "int_list", "float_list", "kv_literal", "kv_str", "float_or_list"].includes(opt.type)
      && /^[\[{]/.test(v.trim())) return v.trim();
  if (opt.type === "steps_or_fraction" && v.trim() !== "" && !isNaN(Number(v))) return v.trim();
  if (opt.type === "resolution" && /^\d+$/.test(v.trim())) return v.trim();
  return JSON.stringify(v);
}

function rawToInput(opt, raw) {
  raw = raw.replace(/\s+#.*$/, "");
  if (opt.type === "bool") return raw === "true";
  if (/^".*"$/.test(raw)) { try { return JSON.parse(raw); } catch (e) { return raw.slice(1, -1); } }
  if (/^'.*'$/.test(raw)) return raw.slice(1, -1);
  return raw;
}

function setKey(name, value) {
  // value null: remove the key's line
  const ta = $("toml"), lines = ta.value.split("\n"), keys = tomlKeys(ta.value);
  if (keys[name] !== undefined) {
    if (value === null) lines.splice(keys[name].line, 1); else lines[keys[name].line] = `${name} = ${value}`;
  } else if (value !== null) {
    // before the first [general] / [[datasets]] table, else at the end
    let at = lines.findIndex((l) => { const h = l.match(HEADER); return h && DATASET_TABLES.includes(h[1].split(".")[0]); });
    if (at < 0) { at = lines.length; while (at > 0 && lines[at - 1] === "") at--; }
    lines.splice(at, 0, `${name} = ${value}`);
  }
  ta.value = lines.join("\n").replace(/\n*$/, "\n");
}

function formFromToml() {
  const keys = tomlKeys($("toml").value);
  document.querySelectorAll("#form .field").forEach((f) => {
    const opt = byName[f.dataset.name], input = f.querySelector("input,select"), k = keys[opt.name];
    if (opt.type === "bool") input.checked = k ? rawToInput(opt, k.raw) : !!opt.default;
    else input.value = k ? rawToInput(opt, k.raw) : "";
  });
}

function buildForm() {
  const script = $("script").value, form = $("form"), q = $("search").value.toLowerCase();
  form.textContent = "";
  for (const sec of schema.sections) {
    const opts = schema.options.filter((o) => o.section === sec.name && o.scripts.includes(script)
      && (!q || o.name.includes(q) || o.help.toLowerCase().includes(q)));
    if (!opts.length) continue;
    const d = el("details", { class: "section" }, el("summary", { text: `${sec.title} (${opts.length})` }));
    if (q || sec.name === "model" || sec.name === "config") d.open = true;
    for (const o of opts) {
      let input;
      const choices = (o.choices_by_script && o.choices_by_script[script]) || o.choices;
      if (o.type === "bool") input = el("input", { type: "checkbox" });
      else if (choices) {
        input = el("select", {}, el("option", { value: "", text: `(default: ${o.default ?? "unset"})` }));
        for (const c of choices) input.append(el("option", { value: String(c), text: String(c) }));
      } else input = el("input", { type: "text", placeholder: o.default === null ? "unset" : `default: ${JSON.stringify(o.default)}` });
      input.id = "opt-" + o.name;
      input.addEventListener(o.type === "bool" || choices ? "change" : "input", () => {
        const v = o.type === "bool" ? input.checked : input.value;
        const isDefault = o.type === "bool" ? v === !!o.default : v === "";
        setKey(o.name, isDefault ? null : tomlValue(o, v));
        scheduleCheck();
      });
      const range = o.min !== null || o.max !== null ? ` [${o.min ?? ""}..${o.max ?? ""}]` : "";
      const cell = o.type === "path" || o.name === "pretrained_model_name_or_path" ? el("span", { class: "with-pick" }, input, pathButton(input)) : input;
      d.append(el("div", { class: "field", "data-name": o.name },
        el("label", { for: input.id, text: o.name, title: o.type }), cell,
        el("div", { class: "help", text: `${o.type}${range}. ${o.help}` }), el("div", { class: "ferr" })));
    }
    form.append(d);
  }
  formFromToml();
  showErrors(lastCheck);
}

// ---- validation as you type ----
let quickTimer = null, memTimer = null;
function scheduleCheck() {
  clearTimeout(quickTimer); clearTimeout(memTimer);
  quickTimer = setTimeout(() => check(false), 300);
  memTimer = setTimeout(() => check(true), 1500);
}

async function check(memory) {
  const body = { script: $("script").value, config: $("toml").value, processes: Number($("processes").value), memory };
  const sent = body.config;
  let r;
  try { r = await api("POST", "/api/validate", body); } catch (e) { return; }
  if ($("toml").value !== sent || r.status !== 200) return;  // an older answer
  lastCheck = r.data;
  showErrors(r.data); showPlans(r.data);
  if (memory) showMemory(r.data);
}

function showErrors(v) {
  document.querySelectorAll("#form .field").forEach((f) => { f.classList.remove("has-error"); f.querySelector(".ferr").textContent = ""; });
  $("errors").textContent = ""; $("warnings").textContent = "";
  if (!v) return;
  for (const e of v.errors) {
    const f = document.querySelector(`#form .field[data-name="${e.option}"]`);
    if (f) { f.classList.add("has-error"); f.querySelector(".ferr").textContent = e.message; }
    $("errors").append(el("div", { class: "error-line", text: e.message }));
  }
  for (const w of v.warnings) $("warnings").append(el("div", { text: "warning: " + w }));
  if (v.ok) $("errors").append(el("div", { class: "ok", style: "color:#2a7a2a", text: "config OK" }));
}

function showPlans(v) {
  const t = $("plans"); t.textContent = "";
  t.append(el("tr", {}, ...["processes", "global batch", "steps / epoch", "epochs", "total steps"].map((h) => el("th", { text: h }))));
  for (const n of ["1", "2", "4", "8"]) {
    const p = v.plans[n];
    if (!p) continue;
    t.append(el("tr", {}, ...[n, p.global_batch, p.steps_per_epoch, p.epochs, p.total_steps].map((x) => el("td", { text: String(x) }))));
  }
}

function showMemory(v) {
  const m = v.memory;
  $("memory").textContent = m ? `${m.total_gib.toFixed(2)} GiB per process (peak at ${m.peak_phase}); ` +
    `parameters ${m.parameters_gib.toFixed(2)}, gradients ${m.gradients_gib.toFixed(2)}, optimizer ${m.optimizer_gib.toFixed(2)}, ` +
    `activations ${m.activations_gib.toFixed(2)} GiB` : "-";
  showFits();
}
function showFits() {
  const m = lastCheck && lastCheck.memory;
  const gib = Number($("fits-gib").value);
  $("fits").textContent = !m ? "" : m.total_gib <= gib ? `yes (${(gib - m.total_gib).toFixed(2)} GiB to spare)` : `no (${(m.total_gib - gib).toFixed(2)} GiB short)`;
}

// ---- pages ----
function route() {
  const h = location.hash || "#/new";
  document.querySelectorAll(".page").forEach((p) => (p.hidden = true));
  document.querySelectorAll("header a").forEach((a) => a.classList.toggle("active", h.startsWith(a.getAttribute("href"))));
  if (events) { events.close(); events = null; }
  clearInterval(runTimer);
  const m = h.match(/^#\/run\/(\d+)/);
  if (m) { $("page-run").hidden = false; showRun(Number(m[1])); }
  else if (h.startsWith("#/queue")) { $("page-queue").hidden = false; showQueue(); runTimer = setInterval(showQueue, 2000); }
  else if (h.startsWith("#/dataset")) { $("page-dataset").hidden = false; showWorkbench(); showDataset(); }
  else if (h.startsWith("#/generate")) { $("page-generate").hidden = false; showGenerate(); }
  else $("page-new").hidden = false;
}

function bucketChart(buckets) {
  // an SVG bar per bucket: "<width>x<height>: <samples>"
  const max = Math.max(1, ...buckets.map((b) => b.samples)), w = 60, hgt = 120;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", String(Math.max(200, buckets.length * w + 20))); svg.setAttribute("height", String(hgt + 40));
  buckets.forEach((b, i) => {
    const h = (b.samples / max) * hgt, x = 10 + i * w;
    const r = document.createElementNS(svg.namespaceURI, "rect");
    Object.entries({ x, y: hgt - h + 5, width: w - 10, height: h, class: "bar" }).forEach(([k, v]) => r.setAttribute(k, v));
    const t = document.createElementNS(svg.namespaceURI, "text");
    Object.entries({ x, y: hgt + 20, "font-size": 11 }).forEach(([k, v]) => t.setAttribute(k, v));
    t.textContent = `${b.width}x${b.height}: ${b.samples}`;
    svg.append(r, t);
  });
  return svg;
}

async function showDataset() {
  await check(false);
  const v = lastCheck; $("dataset-error").textContent = "";
  for (const t of ["subsets", "captions", "buckets"]) $(t).textContent = "";
  if (!v || !v.dataset) { $("dataset-error").textContent = v && v.errors.length ? v.errors[0].message : "no dataset in the config"; return; }
  const d = v.dataset;
  $("subsets").append(el("tr", {}, ...["folder", "images", "repeats", "images x repeats", "regularisation"].map((h) => el("th", { text: h }))));
  for (const s of d.subsets) $("subsets").append(el("tr", {}, el("td", { class: "l", text: s.folder }), el("td", { text: s.images }),
    el("td", { text: s.repeats }), el("td", { text: s.images * s.repeats }), el("td", { text: s.is_reg ? "yes" : "" })));
  $("buckets").append(bucketChart(d.buckets));
  $("captions").append(el("tr", {}, el("th", { text: "image" }), el("th", { text: "caption" })));
  // weighted_captions: each piece with the weight its tokens get (x1.00 pieces as plain text)
  const shown = (c) => c.weights ? c.weights.map(([p, w]) => w === 1 ? p : `${p}[x${w.toFixed(2)}]`).join("") : c.caption;
  for (const c of d.captions) $("captions").append(el("tr", {}, el("td", { class: "l", text: c.image }), el("td", { class: "l", text: shown(c) })));
}

function fmtTime(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s); return s >= 3600 ? `${Math.floor(s / 3600)}h${Math.floor(s % 3600 / 60)}m` : s >= 60 ? `${Math.floor(s / 60)}m${s % 60}s` : `${s}s`;
}

function plot(canvas, series) {
  // series: [{points: [[x, y]], color, dots}]
  const c = canvas.getContext("2d"), W = canvas.width, H = canvas.height, pad = 36;
  c.clearRect(0, 0, W, H);
  const all = series.flatMap((s) => s.points).filter((p) => p[1] !== null && isFinite(p[1]));
  if (!all.length) return;
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y1 += Math.abs(y0) * 0.1 || 1; y0 -= Math.abs(y0) * 0.1 || 1; }
  const X = (x) => pad + (x - x0) / (x1 - x0) * (W - pad - 8), Y = (y) => H - 18 - (y - y0) / (y1 - y0) * (H - 28);
  c.strokeStyle = "#999"; c.beginPath(); c.moveTo(pad, 4); c.lineTo(pad, H - 18); c.lineTo(W - 4, H - 18); c.stroke();
  c.fillStyle = "#444"; c.font = "10px sans-serif";
  c.fillText(y1.toPrecision(3), 2, 12); c.fillText(y0.toPrecision(3), 2, H - 20); c.fillText(String(x0), pad, H - 5); c.fillText(String(x1), W - 30, H - 5);
  for (const s of series) {
    c.strokeStyle = c.fillStyle = s.color;
    const pts = s.points.filter((p) => p[1] !== null && isFinite(p[1]));
    if (s.dots) { for (const p of pts) { c.beginPath(); c.arc(X(p[0]), Y(p[1]), 3, 0, 7); c.fill(); } continue; }
    c.beginPath(); pts.forEach((p, i) => (i ? c.lineTo(X(p[0]), Y(p[1])) : c.moveTo(X(p[0]), Y(p[1])))); c.stroke();
  }
}

async function showRun(id) {
  $("run-id").textContent = "#" + id;
  for (const k of ["run-msg", "run-state", "run-error", "log", "outputs", "samples"]) $(k).textContent = "";
  $("run-step").textContent = "0"; $("run-total").textContent = "?";
  const st = { steps: [], val: [], samples: {}, prompts: 0 };
  const draw = () => {
    let ema = null; const smooth = st.steps.map(([s, l]) => [s, (ema = ema === null ? l : 0.9 * ema + 0.1 * l)]);
    plot($("plot-loss"), [{ points: st.steps.map((p) => [p[0], p[1]]), color: "#9bb7e8" }, { points: smooth, color: "#1f4fb0" },
      { points: st.val, color: "#d0421b", dots: true }]);
    plot($("plot-lr"), [{ points: st.steps.map((p) => [p[0], p[2]]), color: "#2a7a2a" }]);
    plot($("plot-norm"), [{ points: st.steps.map((p) => [p[0], p[3]]), color: "#8a3ab9" }]);
  };
  const refresh = async () => {
    const r = await api("GET", `/api/jobs/${id}`);
    if (r.status !== 200) { $("run-error").textContent = r.data.error; return; }
    const j = r.data;
    $("run-state").textContent = j.state; $("run-state").className = "state " + j.state;
    $("run-step").textContent = j.step; $("run-total").textContent = j.total_steps ?? "?";
    $("run-epoch").textContent = j.epoch ?? "-"; $("run-loss").textContent = j.loss === null ? "-" : j.loss.toFixed(4);
    $("run-lr").textContent = j.lr === null ? "-" : j.lr.toExponential(2); $("run-eta").textContent = fmtTime(j.eta_s);
    $("run-error").textContent = j.error || "";
    $("outputs").textContent = "";
    for (const o of j.outputs) $("outputs").append(el("li", {}, el("a", { href: `/api/jobs/${id}/files/${o}`, text: o })));
    const t = $("samples"); t.textContent = "";
    if (j.sample_steps.length) {
      const n = Math.max(...j.sample_steps.map((s) => s.files.length));
      t.append(el("tr", {}, el("th", { text: "step" }), ...Array.from({ length: n }, (_, i) => el("th", { text: `prompt ${i}` }))));
      for (const s of j.sample_steps) t.append(el("tr", {}, el("td", { text: s.step }),
        ...s.files.map((f) => el("td", {}, el("img", { src: `/api/jobs/${id}/files/${f}`, alt: f, class: "sample" })))));
    }
    const log = await api("GET", `/api/jobs/${id}/log?lines=80`);
    $("log").textContent = log.data; $("log").scrollTop = 1e9;
    $("btn-stop").disabled = !["queued", "running"].includes(j.state);
    $("btn-save").disabled = $("btn-sample").disabled = j.state !== "running";
    $("btn-resume").disabled = !["stopped", "interrupted", "failed"].includes(j.state);
    $("btn-delete").disabled = ["running", "stopping"].includes(j.state);
    await showCompare(j);  // images.js: a finished LoRA run's checkpoint grid
  };
  const act = (name, method = "POST", path = `/api/jobs/${id}/${name}`) => async () => {
    const r = await api(method, path);
    $("run-msg").textContent = r.status >= 400 ? r.data.error : "";
    if (method === "DELETE" && r.status === 200) { location.hash = "#/queue"; return; }
    if (name === "resume" && r.status === 200) { route(); return; }
    refresh();
  };
  $("btn-stop").onclick = act("stop"); $("btn-save").onclick = act("save_now"); $("btn-sample").onclick = act("sample_now");
  $("btn-resume").onclick = act("resume"); $("btn-delete").onclick = act("", "DELETE", `/api/jobs/${id}`);
  await refresh();
  events = new EventSource(`/api/jobs/${id}/events`);
  events.onmessage = (m) => {
    const e = JSON.parse(m.data);
    if (e.event === "plan") st.steps = st.steps.filter((p) => p[0] <= e.start_step);
    else if (e.event === "step") st.steps.push([e.step, e.loss, e.lr, e.grad_norm]);
    else if (e.event === "validation") st.val.push([e.step, e.loss]);
    if (e.event === "step") { $("run-step").textContent = e.step; $("run-loss").textContent = e.loss.toFixed(4); }
    draw();
    if (e.event !== "step") refresh();
  };
  events.addEventListener("state", () => { events.close(); refresh(); });
  runTimer = setInterval(refresh, 3000);
}

async function showQueue() {
  const r = await api("GET", "/api/jobs");
  const t = $("jobs"); t.textContent = "";
  t.append(el("tr", {}, ...["id", "script", "state", "step", "loss", "created", "output", ""].map((h) => el("th", { text: h }))));
  $("jobs-empty").hidden = r.data.jobs.length > 0;
  const jobs = r.data.jobs.slice().sort((a, b) => (a.queue_index ?? 1e9) - (b.queue_index ?? 1e9) || b.id - a.id);
  for (const j of jobs) {
    const act = (label, fn) => el("button", { text: label, onclick: async () => { const x = await fn(); if (x.status >= 400) alert(x.data.error); showQueue(); } });
    const buttons = el("td", { class: "l" }, el("a", { href: `#/run/${j.id}`, text: "open" }), " ");
    if (j.state === "queued") buttons.append(
      act("up", () => api("POST", `/api/jobs/${j.id}/move`, { index: Math.max(0, j.queue_index - 1) })),
      act("down", () => api("POST", `/api/jobs/${j.id}/move`, { index: j.queue_index + 1 })),
      act("cancel", () => api("DELETE", `/api/jobs/${j.id}`)));
    else if (j.state === "running") buttons.append(act("stop", () => api("POST", `/api/jobs/${j.id}/stop`)));
    else if (j.state !== "stopping") buttons.append(act("remove", () => api("DELETE", `/api/jobs/${j.id}`)));
    t.append(el("tr", { "data-id": j.id }, el("td", { text: j.id }), el("td", { class: "l", text: j.script }),
      el("td", {}, el("span", { class: "state " + j.state, text: j.state })), el("td", { text: `${j.step} / ${j.total_steps ?? "?"}` }),
      el("td", { text: j.loss === null ? "-" : j.loss.toFixed(4) }), el("td", { text: new Date(j.created * 1000).toLocaleString() }),
      el("td", { class: "l", text: j.output_dir }), buttons));
  }
}

// ---- start ----
async function init() {
  const r = await api("GET", "/api/schema");
  schema = r.data; byName = Object.fromEntries(schema.options.map((o) => [o.name, o]));
  $("script").textContent = "";
  for (const s of schema.scripts) $("script").append(el("option", { text: s }));
  if (!$("toml").value) $("toml").value = localStorage.getItem("sdtk.toml") ||
    'pretrained_model_name_or_path = "tiny-sd15"\ntrain_data_dir = ""\nresolution = 64\noutput_dir = ""\nmax_train_steps = 10\ncache_latents = true\n';
  buildForm(); route(); scheduleCheck();
}
$("script").addEventListener("change", () => { buildForm(); scheduleCheck(); });
$("processes").addEventListener("change", scheduleCheck);
$("search").addEventListener("input", buildForm);
$("fits-gib").addEventListener("input", showFits);
$("toml").addEventListener("input", () => { localStorage.setItem("sdtk.toml", $("toml").value); formFromToml(); scheduleCheck(); });
$("import").addEventListener("click", async () => {
  const r = await api("POST", "/api/import", { text: $("import-text").value, script: $("script").value });
  $("import-notes").textContent = "";
  if (r.status !== 200) { $("import-notes").append(el("li", { class: "error", text: r.data.error })); return; }
  $("toml").value = r.data.config; formFromToml(); scheduleCheck();
  for (const n of r.data.notes) $("import-notes").append(el("li", { text: n }));
});
$("start").addEventListener("click", async () => {
  $("start-error").textContent = "";
  const r = await api("POST", "/api/jobs", { script: $("script").value, config: $("toml").value, processes: Number($("processes").value) });
  if (r.status === 201) { location.hash = `#/run/${r.data.id}`; return; }
  $("start-error").textContent = r.data.errors ? r.data.errors.map((e) => e.message).join("; ") : r.data.error;
});
window.addEventListener("hashchange", route);
init().catch(() => {});
