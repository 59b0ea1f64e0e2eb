// sdtk UI: the Generate page and a run's Compare panel, over /api/generate, /api/jobs/{id}/compare
// and /api/jobs/{id}/images (docs/UI.md). Uses app.js's $, el, api and dataset.js's pathButton.
"use strict";

// seed, steps, size, sampler, scale: the same fields for both forms (empty: gen_img's defaults)
const SAMPLING = [["seed", "seed", "1"], ["steps", "steps", "default"], ["width", "width", "default"],
  ["height", "height", "default"], ["sampler", "sampler", "ddim"], ["scale", "CFG scale", "default"]];

function samplingFields(box, prefix) {
  box.textContent = "";
  for (const [name, label, ph] of SAMPLING) {
    box.append(el("label", { text: label + " " }, el("input", { id: `${prefix}-${name}`, type: "text", size: "7", placeholder: ph })));
  }
}
function samplingValues(prefix) {
  const out = {};
  for (const [name] of SAMPLING) {
    const v = $(`${prefix}-${name}`).value.trim();
    if (v !== "") out[name] = name === "sampler" ? v : Number(v);
  }
  return out;
}
function setState(span, state, text) { span.textContent = text ?? state ?? ""; span.className = "state " + (state || ""); }
const fileUrl = (id, name) => `/api/jobs/${id}/files/${name.split("/").map(encodeURIComponent).join("/")}`;

async function waitJob(id, onState) {
  // polls the job until it has finished; its last view
  for (;;) {
    const r = await api("GET", `/api/jobs/${id}`);
    if (r.status !== 200) throw new Error(r.data.error);
    onState(r.data);
    if (["done", "failed", "stopped", "interrupted"].includes(r.data.state)) return r.data;
    await new Promise((res) => setTimeout(res, 1000));
  }
}

// ---- the Generate page ----
function loraRow(path = "", weight = "1.0") {
  const p = el("input", { type: "text", class: "lora-path", placeholder: "a LoRA file", value: path });
  const w = el("input", { type: "text", class: "lora-weight", size: "5", value: weight });
  const row = el("div", { class: "with-pick lora" }, p, pathButton(p), w);
  row.append(el("button", { type: "button", text: "remove", onclick: () => row.remove() }));
  $("gen-loras").append(row);
}

function showImages(box, id, images) {
  box.textContent = "";
  for (const im of images) {
    box.append(el("figure", { class: "gen" }, el("img", { src: fileUrl(id, im.name), alt: im.name }),
      el("figcaption", {}, el("b", { text: im.name }), el("pre", { class: "infotext", text: im.parameters || "" }))));
  }
}

let generateReady = false;
// gen_img's flags for a model's separate parts (library/config/options.py GEN_IMG_PARTS)
const GEN_PARTS = [["vae", "SD VAE; SD3 / Anima autoencoder"], ["ae", "FLUX.1 / Chroma / Lumina 2 autoencoder"],
  ["clip_l", "FLUX.1 / SD3"], ["clip_g", "SD3"], ["t5xxl", "FLUX.1 / SD3 / Chroma"], ["tokenizer_path", "SD CLIP tokenizer"],
  ["qwen3", "Anima"], ["llm_adapter_path", "Anima"], ["t5_tokenizer_path", "Anima"], ["gemma2", "Lumina 2"]];
function showGenerate() {
  if (generateReady) return;
  generateReady = true;
  samplingFields($("gen-sampling"), "gen");
  $("gen-model").after(pathButton($("gen-model")));
  for (const [name, what] of GEN_PARTS) {
    const input = el("input", { type: "text", id: `gen-part-${name}`, class: "gen-part", "data-part": name });
    $("gen-parts").append(el("label", { for: input.id, text: `${name} (${what})` }),
      el("span", { class: "with-pick" }, input, pathButton(input)));
  }
  const sp = el("input", { type: "text", id: "gen-system-prompt" });
  $("gen-parts").append(el("label", { for: sp.id, text: "system_prompt (Lumina 2: the run's)" }), sp);
  $("gen-outdir").after(pathButton($("gen-outdir")));
}
$("gen-add-lora").addEventListener("click", () => loraRow());
$("gen-start").addEventListener("click", async () => {
  $("gen-msg").textContent = ""; $("gen-images").textContent = "";
  const loras = [...document.querySelectorAll("#gen-loras .lora")].map((r) => ({
    path: r.querySelector(".lora-path").value, weight: Number(r.querySelector(".lora-weight").value) }));
  const body = { model: $("gen-model").value, prompt: $("gen-prompt").value, negative_prompt: $("gen-negative").value,
    parts: Object.fromEntries([...document.querySelectorAll("#gen-parts .gen-part")].filter((i) => i.value.trim())
      .map((i) => [i.dataset.part, i.value.trim()])), system_prompt: $("gen-system-prompt").value,
    loras, outdir: $("gen-outdir").value, images: Number($("gen-images-n").value), ...samplingValues("gen") };
  const r = await api("POST", "/api/generate", body);
  if (r.status !== 201) { $("gen-msg").textContent = r.data.error; return; }
  $("gen-start").disabled = true;
  try {
    const j = await waitJob(r.data.id, (j) => setState($("gen-state"), j.state));
    if (j.state !== "done") { $("gen-msg").textContent = j.error || j.state; return; }
    const im = await api("GET", `/api/jobs/${j.id}/images`);
    showImages($("gen-images"), j.id, im.data.images);
  } finally { $("gen-start").disabled = false; }
});

// ---- a run's Compare panel: the newest grid job of this run ----
let compareRun = null;
async function showCompare(run) {
  // called by the run page's refresh with the run's view
  const panel = $("compare");
  panel.hidden = !(run.script === "train_lora" && ["done", "stopped", "failed", "interrupted"].includes(run.state));
  if (panel.hidden) return;
  if (compareRun !== run.id) {
    compareRun = run.id;
    samplingFields($("cmp-sampling"), "cmp");
    $("cmp-seed").value = "1";
    for (const k of ["cmp-msg", "cmp-grid", "cmp-cells"]) $(k).textContent = "";
    setState($("cmp-state"), "");
  }
  const jobs = (await api("GET", "/api/jobs")).data.jobs.filter((j) => j.run === run.id);
  if (!jobs.length) return;
  const g = jobs.reduce((a, b) => (a.id > b.id ? a : b));
  setState($("cmp-state"), g.state, `grid #${g.id}: ${g.state}` + (g.state === "running" && g.total_steps ? ` ${g.step}/${g.total_steps}` : ""));
  $("cmp-msg").textContent = g.state === "failed" ? g.error || "" : "";
  if (g.state !== "done" || $("cmp-grid").dataset.job === String(g.id)) return;
  const r = await api("GET", `/api/jobs/${g.id}/images`);
  const layout = r.data.grid;
  if (!layout) return;
  $("cmp-grid").dataset.job = String(g.id);
  $("cmp-grid").textContent = "";
  $("cmp-grid").append(el("img", { id: "cmp-grid-img", src: fileUrl(g.id, layout.grid), alt: "checkpoint grid" }));
  // the single images, labelled as in the grid, each with its A1111 text as a tooltip
  const text = Object.fromEntries(r.data.images.map((i) => [i.name, i.parameters || ""]));
  const t = $("cmp-cells"); t.textContent = "";
  t.append(el("tr", {}, el("th", { text: "file" }), ...layout.columns.map((c) => el("th", { text: c.label.join(", ") }))));
  layout.rows.forEach((row, i) => t.append(el("tr", {}, el("td", { class: "l", text: row.label.join(", ") }),
    ...layout.cells[i].map((name) => el("td", {}, el("a", { href: fileUrl(g.id, name), title: text[name] || "" },
      el("img", { src: fileUrl(g.id, name), alt: name, class: "cell" })))))));
}
$("cmp-queue").addEventListener("click", async () => {
  $("cmp-msg").textContent = "";
  const body = { prompts: $("cmp-prompts").value, multipliers: $("cmp-muls").value, ...samplingValues("cmp") };
  const r = await api("POST", `/api/jobs/${compareRun}/compare`, body);
  if (r.status !== 201) { $("cmp-msg").textContent = r.data.error; return; }
  $("cmp-grid").dataset.job = ""; $("cmp-grid").textContent = ""; $("cmp-cells").textContent = "";
  setState($("cmp-state"), "queued", `grid #${r.data.id}: queued`);
});
