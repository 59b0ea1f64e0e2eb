// sdtk UI: the Dataset workbench and the folder / file picker, over /api/fs and /api/dataset/*
// (docs/UI.md). Uses app.js's $, el and api.
"use strict";

const ds = { folder: null, view: null };
const qs = (o) => Object.entries(o).map(([k, v]) => `${k}=${encodeURIComponent(v)}`).join("&");

// ---- the picker: a folder (or a file, for path fields) inside the allowed paths ----
let pickerDone = null;
async function pickerShow(path) {
  const r = await api("GET", "/api/fs?" + qs({ path: path || "" }));
  $("picker-error").textContent = r.status === 200 ? "" : r.data.error;
  if (r.status !== 200) return;
  $("picker").dataset.path = r.data.path || "";
  $("picker-path").textContent = r.data.path || "allowed folders";
  $("picker-up").disabled = !r.data.path;
  $("picker-up").onclick = () => pickerShow(r.data.parent || "");
  $("picker-choose").disabled = !r.data.path;
  const list = $("picker-list"); list.textContent = "";
  if (!r.data.entries.length) list.append(el("li", { class: "muted", text: "(empty folder)" }));
  for (const e of r.data.entries) {
    list.append(el("li", { text: (e.dir ? "[dir] " : "") + e.name, "data-path": e.path,
      onclick: () => (e.dir ? pickerShow(e.path) : pickerFinish(e.path, true)) }));
  }
}
function pickerFinish(path, isFile = false) { $("picker").close(); if (pickerDone && path) pickerDone(path, isFile); pickerDone = null; }
function pickPath(start, done) {
  pickerDone = done;
  $("picker").showModal();
  pickerShow(start).catch(() => {});
}
$("picker-choose").addEventListener("click", () => pickerFinish($("picker").dataset.path));
$("picker-cancel").addEventListener("click", () => pickerFinish(null));

function pathButton(input) {
  // a "..." button beside a New run path field (model, data, output, VAE, ...)
  return el("button", { type: "button", class: "pick", title: "browse", text: "...", onclick: () =>
    pickPath(input.value, (p) => { input.value = p; input.dispatchEvent(new Event("input")); }) });
}

// ---- the workbench ----
function dsMsg(text) { $("ds-msg").textContent = text || ""; }
function filterParams() {
  const f = $("ds-filter").value.trim();
  return f.startsWith("tag:") ? { tag: f.slice(4).trim(), q: "" } : { tag: "", q: f };
}

async function openFolder() {
  const folder = $("ds-folder").value.trim();
  if (!folder) { dsMsg("type or browse to a folder first"); return; }
  const r = await api("GET", "/api/dataset?" + qs({ folder, ext: $("ds-ext").value, ...filterParams() }));
  if (r.status !== 200) { dsMsg(r.data.error); return; }
  dsMsg(""); ds.folder = r.data.folder; ds.view = r.data;
  localStorage.setItem("sdtk.dataset", folder);
  $("ds-empty").hidden = true; $("ds-work").hidden = false;
  showFolder(r.data);
  showPreview().catch(() => {});
}

function showFolder(v) {
  $("ds-info").textContent = `${v.folder}: ${v.images.length} of ${v.total} image(s) shown` +
    (v.repeats ? `, ${v.repeats} repeats` : "") + (v.writable ? "" : " (read-only folder: captions cannot be saved here)") +
    (v.total ? "" : ". No images yet: drop some below, or create a concept folder and open it.");
  $("ds-repeats").value = v.repeats || "";
  $("ds-undo").disabled = !v.undo;
  const fl = $("ds-folders"); fl.textContent = "";
  for (const f of v.folders) fl.append(el("button", { type: "button", text: `${f.name} (${f.images})`,
    onclick: () => { $("ds-folder").value = f.path; openFolder(); } }), " ");
  const grid = $("ds-grid"); grid.textContent = "";
  for (const img of v.images) grid.append(tile(img));
  const t = $("ds-tags"); t.textContent = "";
  t.append(el("tr", {}, el("th", { text: "tag" }), el("th", { text: "captions" })));
  if (!v.tags.length) t.append(el("tr", {}, el("td", { class: "l muted", colspan: "2", text: "no tags: no caption files with this extension" })));
  for (const [tag, n] of v.tags) t.append(el("tr", {}, el("td", { class: "l" }, el("span", { class: "tag-link", text: tag,
    onclick: () => { $("ds-tag").value = tag; $("ds-filter").value = "tag:" + tag; openFolder(); } })), el("td", { text: n })));
}

function tile(img) {
  const box = el("div", { class: "tile", "data-name": img.name });
  const pic = el("img", { src: "/api/dataset/thumb?" + qs({ path: img.path }), alt: img.name, loading: "lazy" });
  pic.addEventListener("error", async () => {
    const r = await api("GET", "/api/dataset/thumb?" + qs({ path: img.path }));
    // the tile names the file below: the box says why (the path is in the API's error only)
    const why = r.data && (r.data.reason || r.data.error);
    pic.replaceWith(el("div", { class: "broken", text: why || "cannot show this image" }));
  });
  const ta = el("textarea", { spellcheck: "false", placeholder: "no caption" });
  ta.value = img.caption ?? "";
  const status = el("div", { class: "status", text: img.error || "" });
  let base = img.hash, saved = ta.value;
  if (img.error) { ta.disabled = true; box.classList.add("failed"); }
  const save = async () => {
    if (ta.value === saved) return;
    const r = await api("PUT", "/api/dataset/caption", { path: img.path, ext: $("ds-ext").value, text: ta.value, base_hash: base });
    box.classList.remove("saved", "stale", "failed");
    if (r.status === 200) { base = r.data.hash; saved = ta.value; box.classList.add("saved"); status.textContent = "saved"; $("ds-undo").disabled = false; showPreview().catch(() => {}); return; }
    box.classList.add(r.status === 409 ? "stale" : "failed");
    status.textContent = r.data.error;
    if (r.status === 409 && r.data.current_hash !== undefined) {
      status.append(" ", el("button", { type: "button", text: "load theirs", onclick: () => {
        ta.value = r.data.current ?? ""; saved = ta.value; base = r.data.current_hash; status.textContent = ""; box.classList.remove("stale"); } }));
    }
  };
  ta.addEventListener("blur", save);
  ta.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); save(); } });
  box.append(pic, el("div", { text: img.name }), ta, status);
  return box;
}

async function showPreview() {
  const r = await api("POST", "/api/dataset/preview", { folder: ds.folder, ext: $("ds-ext").value, resolution: Number($("ds-res").value) });
  $("ds-buckets").textContent = ""; $("ds-trained").textContent = "";
  if (r.status !== 200) { $("ds-buckets").textContent = r.data.error; return; }
  $("ds-buckets").append(bucketChart(r.data.buckets));
  $("ds-trained").append(el("tr", {}, el("th", { text: "image" }), el("th", { text: "caption" })));
  for (const c of r.data.captions) $("ds-trained").append(el("tr", {}, el("td", { class: "l", text: c.image }), el("td", { class: "l", text: c.caption })));
}

async function dsPost(method, path, body, then) {
  const r = await api(method, path, body);
  dsMsg(r.status === 200 ? "" : r.data.error);
  if (r.status === 200) { if (then) then(r.data); await openFolder(); }
  return r;
}

$("ds-open").addEventListener("click", openFolder);
$("ds-folder").addEventListener("keydown", (e) => { if (e.key === "Enter") openFolder(); });
$("ds-filter").addEventListener("input", () => { if (ds.folder) openFolder(); });
$("ds-res").addEventListener("change", () => { if (ds.folder) showPreview(); });
$("ds-browse").addEventListener("click", () => pickPath($("ds-folder").value, (p, isFile) => {
  $("ds-folder").value = isFile ? p.replace(/\/[^\/]*$/, "") : p; openFolder(); }));  // an image: its folder
$("ds-undo").addEventListener("click", () => dsPost("POST", "/api/dataset/undo", { folder: ds.folder },
  (d) => alert(`restored ${d.restored.length} caption(s)` + (d.kept.length ? `; kept ${d.kept.length} changed since` : ""))));
$("ds-apply").addEventListener("click", () => dsPost("POST", "/api/dataset/tags", {
  folder: ds.folder, ext: $("ds-ext").value, op: $("ds-op").value, tag: $("ds-tag").value, new: $("ds-new").value,
  images: $("ds-only-shown").checked ? ds.view.images.map((i) => i.name) : null }));
$("ds-create").addEventListener("click", () => dsPost("POST", "/api/dataset/concept",
  { parent: ds.folder, name: $("ds-cname").value, repeats: Number($("ds-crepeats").value) }));
$("ds-setrepeats").addEventListener("click", async () => {
  const r = await api("POST", "/api/dataset/repeats", { folder: ds.folder, repeats: Number($("ds-repeats").value) });
  dsMsg(r.status === 200 ? "" : r.data.error);
  if (r.status === 200) { $("ds-folder").value = r.data.path; openFolder(); }
});
$("ds-run").addEventListener("click", async () => {
  const words = [...$("ds-args").value.matchAll(/"([^"]*)"|'([^']*)'|(\S+)/g)].map((m) => (m[1] ?? m[2] ?? m[3]).replaceAll("{folder}", ds.folder));
  const r = await api("POST", "/api/jobs", { tool: $("ds-tool").value, args: words });
  if (r.status === 201) { location.hash = `#/run/${r.data.id}`; return; }
  dsMsg(r.data.errors ? r.data.errors.map((e) => e.message).join("; ") : r.data.error);
});

// uploads: dropped files, one request each (type and size are checked by the server)
const drop = $("ds-drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
async function uploadFiles(list) {
  const errors = [];
  for (const f of list) {
    const r = await fetch("/api/dataset/upload?" + qs({ folder: ds.folder, name: f.name }),
      { method: "PUT", body: f, headers: { "content-type": "application/octet-stream" }, credentials: "same-origin" });
    if (r.status !== 200) errors.push((await r.json()).error);
  }
  await openFolder();
  dsMsg(errors.join("; "));
}
drop.addEventListener("drop", (e) => { e.preventDefault(); drop.classList.remove("over"); uploadFiles(e.dataTransfer.files); });
$("ds-files").addEventListener("change", () => { uploadFiles($("ds-files").files).then(() => { $("ds-files").value = ""; }); });

async function showWorkbench() {
  if (!$("ds-tool").options.length) {
    const r = await api("GET", "/api/tools");
    for (const t of r.data.tools) $("ds-tool").append(el("option", { value: t, text: t }));
  }
  if (!$("ds-folder").value) $("ds-folder").value = localStorage.getItem("sdtk.dataset") || "";
}
