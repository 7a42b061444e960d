// tserve playground, the task card's entities panel: a text through POST /v1/models/{model}/entities (token
// classification), drawn as the text with each entity's span highlighted, one colour per label, with a legend.
// Built from text nodes only (never innerHTML: the text and the labels are the user's and the model's). Shares $, api,
// guarded, adapter, modelPath and state with playground.js. No build step, no deps.
"use strict";

// The text cut at the entities' offsets: [{text, entity}] in text order, entity null between entities. The service's
// start/end count code points (Python str indices) while a JS string counts UTF-16 units (an emoji is two), so the
// text is cut as its array of code points. The service's entities come in text order and do not overlap; one without
// offsets (a tokenizer that gives none) has no span to draw and is left out.
function entitySegments(text, entities) {
  const chars = Array.from(text);
  const segments = [];
  let at = 0;
  for (const entity of entities.filter((e) => Number.isInteger(e.start) && Number.isInteger(e.end))) {
    if (entity.start > at) segments.push({ text: chars.slice(at, entity.start).join(""), entity: null });
    segments.push({ text: chars.slice(entity.start, entity.end).join(""), entity });
    at = entity.end;
  }
  if (at < chars.length) segments.push({ text: chars.slice(at).join(""), entity: null });
  return segments;
}

// An entity's label: its group (aggregated strategies) or its token's tag (strategy none).
function entityLabel(entity) {
  return entity.entity_group ?? entity.entity;
}

// One colour per label, hues a golden angle apart so that neighbours in the legend differ.
function labelColours(labels) {
  return new Map(labels.map((label, i) => [label, `hsl(${((i * 137.5) % 360).toFixed(1)}, 85%, 82%)`]));
}

function entityMark(entity, text, colour) {
  const mark = document.createElement("mark");
  mark.className = "entity";
  mark.textContent = text;
  mark.style.backgroundColor = colour;
  mark.dataset.label = entityLabel(entity);
  mark.dataset.score = String(entity.score);
  mark.title = `${entityLabel(entity)} · ${entity.score.toFixed(3)}`;
  return mark;
}

function legendItem(label, colour, count) {
  const item = document.createElement("span");
  item.className = "legend-item";
  item.dataset.label = label;
  const swatch = document.createElement("span");
  swatch.className = "swatch";
  swatch.style.backgroundColor = colour;
  item.append(swatch, document.createTextNode(`${label} (${count})`));
  return item;
}

async function runEntities() {
  clearEntities();
  const text = $("entities-input").value;
  const strategy = $("entities-strategy").value;
  const body = { inputs: [text], aggregation_strategy: strategy, adapter: adapter() };
  const [entities] = (await api("POST", modelPath("entities"), body)).outputs;
  const segments = entitySegments(text, entities);
  const drawn = segments.filter((s) => s.entity).map((s) => entityLabel(s.entity));
  const labels = [...new Set(drawn)].sort();
  const colours = labelColours(labels);
  $("entities-output").replaceChildren(...segments.map((s) => (s.entity
    ? entityMark(s.entity, s.text, colours.get(entityLabel(s.entity)))
    : document.createTextNode(s.text))));
  $("entities-legend").replaceChildren(...labels.map((label) =>
    legendItem(label, colours.get(label), drawn.filter((l) => l === label).length)));
  const undrawn = entities.length - drawn.length;
  $("entities-meta").textContent = `${entities.length} ${strategy === "none" ? "tokens" : "entities"} · ` +
    `aggregation ${strategy} · ${state.model.name}` + (undrawn ? ` · ${undrawn} without offsets, not drawn` : "");
  $("entities-output").dataset.done = "true";
}

function clearEntities() {
  $("entities-output").replaceChildren();
  delete $("entities-output").dataset.done;
  $("entities-legend").replaceChildren();
  $("entities-meta").textContent = "";
}

function initEntities() {
  document.addEventListener("tserve:model", clearEntities);
  $("entities-form").addEventListener("submit", (e) => {
    e.preventDefault();
    guarded($("entities-run"), runEntities);
  });
}

document.addEventListener("DOMContentLoaded", initEntities);
