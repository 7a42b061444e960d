// tserve playground: pick a model and adapter, run it, look at its attention; the chat view is chat.js, the rerank
// panel rerank.js, the entities panel entities.js.
// No build step, no deps.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";
const KIND_NAMES = { encoder_self: "encoder self", decoder_self: "decoder self", cross: "cross", self: "self" };
// The task card's panel of each family, and the task (GET /v1/models' tasks) it needs.
const TASKS = {
  seq2seq: { task: "generate", title: "Translate", form: "generate-form", input: "Source sentence", strategy: "beam" },
  causal_lm: { task: "generate", title: "Generate", form: "generate-form", input: "Prompt", strategy: "greedy",
    stream: true },
  classifier: { task: "classify", title: "Classify", form: "classify-form", input: "Text" },
};
// The task card's other panels, after the family's own, for the models that serve their task.
const OTHER_PANELS = [
  { task: "entities", title: "Entities", form: "entities-form" },
  { task: "rerank", title: "Rerank", form: "rerank-form" },
];
const PANEL_FORMS = [...new Set([...Object.values(TASKS), ...OTHER_PANELS].map((p) => p.form))];
// A language-identification classifier's example: a message in one of its labels' languages.
const LANGUAGE_EXAMPLES = {
  fr: "Impossible d'ouvrir le fichier.",
  de: "Die Datei konnte nicht geöffnet werden.",
  es: "No se pudo abrir el archivo.",
  it: "Impossibile aprire il file.",
};

// The default text of both cards (task and attention) for model m: what its family, name and labels suggest.
function exampleFor(m) {
  if (m.family === "seq2seq") return "Delete the file?";  // translators of UI messages (the default model's data)
  if (m.family === "causal_lm") {
    return /code|py/i.test(m.name) ? "def read_lines(path):\n    " : "Once upon a time, in a small town by the sea,";
  }
  const labels = m.labels || [];
  const language = Object.keys(LANGUAGE_EXAMPLES).find((code) => labels.includes(code));
  if (language) return LANGUAGE_EXAMPLES[language];
  if (labels.includes("positive") || labels.includes("negative")) return "the food was excellent";
  return "The animal didn't cross the street because it was tired";
}

const state = { models: [], model: null, attention: null };

// ---- HTTP ---------------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    const field = body.error && body.error.field ? ` (field: ${body.error.field})` : "";
    if (body.error) return `${response.status} ${body.error.code}: ${body.error.message}${field}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function api(method, path, body) {
  const response = await fetch(path, { method, headers: headers(), body: body && JSON.stringify(body) });
  if (!response.ok) throw new Error(await errorText(response));
  return response.status === 204 ? null : response.json();
}

function modelPath(suffix) {
  return `v1/models/${encodeURIComponent(state.model.name)}/${suffix}`;
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

async function guarded(button, work) {
  button.disabled = true;
  setStatus("");
  try {
    await work();
  } catch (err) {
    setStatus(err.message, true);
  } finally {
    button.disabled = false;
  }
}

// ---- models and adapters -----------------------------------------------------------------------

async function loadModels() {
  const list = await api("GET", "v1/models");
  state.models = list.data;
  document.dispatchEvent(new CustomEvent("tserve:models", { detail: state.models }));  // chat.js lists its own
  const select = $("model");
  select.replaceChildren(...state.models.map((m) => new Option(`${m.name} (${m.family})`, m.name)));
  if (!state.models.length) {
    setStatus("The server has no models loaded.", true);
    return;
  }
  const wanted = new URLSearchParams(location.search).get("model");
  if (wanted && state.models.some((m) => m.name === wanted)) select.value = wanted;
  await selectModel(select.value);
}

async function selectModel(name) {
  state.model = state.models.find((m) => m.name === name);
  const m = state.model;
  const size = m.parameters >= 1e6 ? `${(m.parameters / 1e6).toFixed(1)}M` : `${(m.parameters / 1e3).toFixed(0)}k`;
  $("model-info").textContent = `${size} parameters · ${m.device} · ${m.dtype} · ≤ ${m.max_input_tokens} input tokens`;
  const task = TASKS[m.family];
  const example = exampleFor(m);
  showPanels(m);
  if (task.form === "generate-form") {
    $("gen-input-label").textContent = task.input;
    $("gen-input").value = example;
    $("gen-strategy").value = task.strategy;
    showStrategyOptions();
    $("gen-stream").checked = Boolean(task.stream);
    $("gen-max").max = m.max_new_tokens || 256;
    $("gen-output").textContent = "";
    $("gen-meta").textContent = "";
    $("gen-to-attention").hidden = true;
  } else {
    $("cls-input").value = example;
    $("cls-output").replaceChildren();
  }
  document.dispatchEvent(new CustomEvent("tserve:model", { detail: m }));  // rerank.js, entities.js clear theirs
  const seq2seq = m.family === "seq2seq";
  $("attn-target-row").hidden = !seq2seq;
  $("attn-input-label").textContent = seq2seq ? "Source" : "Input";
  $("attn-input").value = example;
  $("attn-target").value = "";
  clearHeatmap();
  await fillAdapters($("adapter"), state.model);
}

// The task card's panels for model m (its family's own, then the others it serves), as tabs when there are several;
// the first is shown.
function showPanels(m) {
  const panels = [TASKS[m.family], ...OTHER_PANELS].filter((p) => m.tasks.includes(p.task));
  $("task-panels").replaceChildren(...panels.map((panel) => {
    const tab = document.createElement("button");
    Object.assign(tab, { type: "button", id: `panel-${panel.task}`, textContent: panel.title });
    tab.setAttribute("role", "tab");
    tab.dataset.form = panel.form;
    tab.addEventListener("click", () => showPanel(panel));
    return tab;
  }));
  $("task-panels").hidden = panels.length < 2;
  showPanel(panels[0] || TASKS[m.family]);
}

function showPanel(panel) {
  $("task-title").textContent = panel.title;
  for (const form of PANEL_FORMS) $(form).hidden = form !== panel.form;
  for (const tab of $("task-panels").children) {
    tab.setAttribute("aria-selected", String(tab.dataset.form === panel.form));
  }
}

// The adapters of model m into a <select>, "(base model)" first: the server's list, else the model list's.
async function fillAdapters(select, m) {
  const keep = select.value;
  let names = m.adapters.map((a) => (typeof a === "string" ? a : a.name));
  try {
    names = (await api("GET", `v1/models/${encodeURIComponent(m.name)}/adapters`)).adapters.map((a) => a.name);
  } catch (_) { /* the model list's resident adapters will do */ }
  select.replaceChildren(new Option("(base model)", ""), ...[...new Set(names)].sort().map((n) => new Option(n, n)));
  select.value = names.includes(keep) ? keep : "";
}

function adapter() {
  return $("adapter").value || undefined;
}

// ---- generate (translate / continue), with streaming ------------------------------------------

// Show only the options of the chosen strategy (beam width; temperature and top-p for sampling).
function showStrategyOptions() {
  const strategy = $("gen-strategy").value;
  for (const el of document.querySelectorAll("#generate-form [data-for]")) el.hidden = el.dataset.for !== strategy;
}

function generateBody(stream) {
  const strategy = $("gen-strategy").value;
  const body = {
    inputs: [$("gen-input").value],
    strategy,
    max_new_tokens: Number($("gen-max").value),
    adapter: adapter(),
    stream,
  };
  if (strategy === "beam") body.num_beams = Number($("gen-beams").value);
  if (strategy === "sample") {
    body.temperature = Number($("gen-temp").value);
    body.top_p = Number($("gen-top-p").value);
  }
  return body;
}

async function runGenerate() {
  const out = $("gen-output");
  out.textContent = "";
  $("gen-meta").textContent = "";
  $("gen-to-attention").hidden = true;
  const started = performance.now();
  const stream = $("gen-stream").checked;
  let result;
  if (stream) {
    result = await streamGenerate(generateBody(true), (text) => { out.textContent += text; });
  } else {
    const response = await api("POST", modelPath("generate"), generateBody(false));
    result = response.outputs[0];
    out.textContent = result.text;
  }
  const seconds = (performance.now() - started) / 1000;
  const score = typeof result.score === "number" ? ` · score ${result.score.toFixed(3)}` : "";
  $("gen-meta").textContent =
    `${result.tokens.length} tokens · ${result.finish_reason} · ${seconds.toFixed(2)} s${stream ? " · streamed" : ""}${score}`;
  out.dataset.done = "true";
  if (state.model.family === "seq2seq" && result.text.trim()) $("gen-to-attention").hidden = false;
}

// POST with stream=true and read the server-sent events off the body as they arrive.
async function streamGenerate(body, onText) {
  const response = await fetch(modelPath("generate"), { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) throw new Error(await errorText(response));
  const result = { text: "", tokens: [], finish_reason: null, events: 0 };
  await readEvents(response, (event) => {
    result.events += 1;
    result.text += event.text;
    if (event.token !== null && event.token !== undefined) result.tokens.push(event.token);
    if (event.finish_reason) result.finish_reason = event.finish_reason;
    onText(event.text);
  });
  return result;
}

// Each `data:` event of a server-sent event stream, JSON-decoded, to onEvent as it arrives, up to `data: [DONE]`;
// an error event (the server's, once the stream has started) is thrown.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new Error(`${event.error.code}: ${event.error.message}`);
        onEvent(event);
      }
    }
  }
}

// ---- classify ---------------------------------------------------------------------------------

async function runClassify() {
  const text = $("cls-input").value;
  const pair = $("cls-pair").value.trim();
  const body = { inputs: [pair ? [text, pair] : text], adapter: adapter() };
  const output = (await api("POST", modelPath("classify"), body)).outputs[0];
  const rows = Object.entries(output.probabilities).map(([label, p]) => {
    const row = document.createElement("div");
    row.className = "prob" + (label === output.label ? " best" : "");
    const name = document.createElement("span");
    name.textContent = label;
    const track = document.createElement("span");
    track.className = "track";
    const fill = document.createElement("span");
    fill.style.width = `${(100 * p).toFixed(1)}%`;
    track.append(fill);
    const value = document.createElement("span");
    value.textContent = p.toFixed(3);
    row.append(name, track, value);
    return row;
  });
  $("cls-output").replaceChildren(...rows);
}

// ---- attention heatmap ------------------------------------------------------------------------

async function runAttention() {
  const body = { input: $("attn-input").value };
  const target = $("attn-target").value.trim();
  if (state.model.family === "seq2seq" && target) body.target = target;
  const result = await api("POST", modelPath("attention"), body);
  state.attention = result;
  const kinds = Object.keys(result.maps);
  $("attn-kind").replaceChildren(...kinds.map((k) => new Option(KIND_NAMES[k] || k, k)));
  $("attn-controls").hidden = false;
  fillLayerHead();
  drawHeatmap();
}

function fillLayerHead() {
  const maps = state.attention.maps[$("attn-kind").value];
  const layer = Math.min(Number($("attn-layer").value) || 0, maps.length - 1);
  const head = $("attn-head").value;
  $("attn-layer").replaceChildren(...maps.map((_, i) => new Option(String(i + 1), String(i))));
  $("attn-layer").value = String(layer);
  const nHeads = maps[0].length;
  $("attn-head").replaceChildren(...maps[0].map((_, i) => new Option(String(i + 1), String(i))),
    new Option("mean", "mean"));
  $("attn-head").value = head === "mean" || Number(head) < nHeads ? head || "0" : "0";
}

// Which tokens index the rows (queries) and columns (keys) of a map of this kind.
function axes(kind) {
  const a = state.attention;
  if (kind === "decoder_self") return [a.target_tokens, a.target_tokens];
  if (kind === "cross") return [a.target_tokens, a.source_tokens];
  return [a.source_tokens, a.source_tokens];
}

function selectedMatrix() {
  const heads = state.attention.maps[$("attn-kind").value][Number($("attn-layer").value)];
  const head = $("attn-head").value;
  if (head !== "mean") return heads[Number(head)];
  return heads[0].map((row, q) => row.map((_, k) => heads.reduce((s, h) => s + h[q][k], 0) / heads.length));
}

function shown(token) {
  return token.replace(/ /g, "·").replace(/\n/g, "⏎") || "∅";
}

// Absolute scale (a weight of 1 is darkest), so layers and heads compare at a glance; the square
// root keeps a spread-out head (weights near 1/length) visible without washing out a peaked one.
function color(w) {
  const t = Math.sqrt(Math.min(Math.max(w, 0), 1));
  return `hsl(220, 70%, ${(97 - 70 * t).toFixed(1)}%)`;
}

function svg(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function drawHeatmap() {
  const kind = $("attn-kind").value;
  const [rows, cols] = axes(kind);
  const matrix = selectedMatrix();
  const max = Math.max(...matrix.flat());
  const cell = Math.max(10, Math.min(34, Math.floor(560 / Math.max(rows.length, cols.length))));
  const font = Math.min(13, Math.max(8, cell * 0.45));
  const longest = Math.max(...rows.concat(cols).map((t) => shown(t).length));
  const margin = Math.min(160, 12 + longest * font * 0.62);
  const width = margin + cols.length * cell + 8;
  const height = margin + rows.length * cell + 8;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `${KIND_NAMES[kind] || kind} attention, ${rows.length} × ${cols.length}` });
  root.style.setProperty("--font", `${font}px`);
  cols.forEach((t, k) => {
    const x = margin + k * cell + cell / 2;
    root.append(svg("text", { class: "label key", x, y: margin - 6, transform: `rotate(-60 ${x} ${margin - 6})` },
      shown(t)));
  });
  rows.forEach((t, q) => {
    root.append(svg("text", { class: "label query", x: margin - 6, y: margin + q * cell + cell / 2 }, shown(t)));
    matrix[q].forEach((w, k) => {
      const rect = svg("rect", { class: "cell", x: margin + k * cell, y: margin + q * cell, width: cell, height: cell,
        fill: color(w), "data-q": q, "data-k": k, "data-w": w.toFixed(4) });
      rect.append(svg("title", {}, `${shown(t)} → ${shown(cols[k])}: ${w.toFixed(3)}`));
      root.append(rect);
    });
  });
  $("heatmap").replaceChildren(root);
  const head = $("attn-head").value === "mean" ? "mean of heads" : `head ${Number($("attn-head").value) + 1}`;
  // Decoder rows are the decoder's inputs (<s> + target): each row's weights serve predicting the next token.
  const rowsAre = kind === "cross" || kind === "decoder_self" ? "decoder inputs (each predicts the next token)" : "queries";
  $("attn-caption").textContent = `${KIND_NAMES[kind] || kind} · layer ${Number($("attn-layer").value) + 1} · ` +
    `${head} · rows: ${rowsAre}, columns: keys · white 0 → dark 1 (largest here ${max.toFixed(3)})`;
}

function clearHeatmap() {
  state.attention = null;
  $("attn-controls").hidden = true;
  $("attn-caption").textContent = "";
  $("heatmap").replaceChildren();
}

// ---- wiring -----------------------------------------------------------------------------------

// The models view (task and attention cards) or the chat view; ?tab=chat opens on the chat.
function showView(name) {
  const chat = name === "chat";
  $("models-view").hidden = chat;
  $("model-pickers").hidden = chat;
  $("chat-view").hidden = !chat;
  $("tab-models").setAttribute("aria-selected", String(!chat));
  $("tab-chat").setAttribute("aria-selected", String(chat));
}

function init() {
  showView(new URLSearchParams(location.search).get("tab") === "chat" ? "chat" : "models");
  $("tab-models").addEventListener("click", () => showView("models"));
  $("tab-chat").addEventListener("click", () => showView("chat"));
  $("api-key").value = localStorage.getItem("tserve-api-key") || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("tserve-api-key", $("api-key").value.trim());
    loadModels().catch((err) => setStatus(err.message, true));
  });
  $("model").addEventListener("change", (e) => selectModel(e.target.value).catch((err) => setStatus(err.message, true)));
  $("generate-form").addEventListener("submit", (e) => { e.preventDefault(); guarded($("gen-run"), runGenerate); });
  $("classify-form").addEventListener("submit", (e) => { e.preventDefault(); guarded($("cls-run"), runClassify); });
  $("attn-form").addEventListener("submit", (e) => { e.preventDefault(); guarded($("attn-run"), runAttention); });
  $("gen-to-attention").addEventListener("click", () => {
    $("attn-input").value = $("gen-input").value;
    $("attn-target").value = $("gen-output").textContent;
    guarded($("attn-run"), runAttention);
  });
  $("gen-strategy").addEventListener("change", showStrategyOptions);
  $("attn-kind").addEventListener("change", () => { fillLayerHead(); drawHeatmap(); });
  $("attn-layer").addEventListener("change", drawHeatmap);
  $("attn-head").addEventListener("change", drawHeatmap);
  loadModels().catch((err) => setStatus(`Could not list the models: ${err.message}`, true));
}

document.addEventListener("DOMContentLoaded", init);
