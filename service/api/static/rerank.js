// tserve playground, the task card's rerank panel: a query and documents (one per line) through POST /v1/rerank,
// drawn most relevant first as bars, each with its document and its index in the request. Shares $, api, guarded,
// adapter and state with playground.js. No build step, no deps.
"use strict";

// The documents: the textarea's lines, blank ones left out.
function rerankDocuments() {
  return $("rerank-docs").value.split("\n").filter((line) => line.trim());
}

// The request's model field: the model, or model:adapter.
function rerankModelField() {
  return adapter() ? `${state.model.name}:${adapter()}` : state.model.name;
}

// A bar's length: a score on a scale from min(0, lowest) to max(1, highest), so sigmoid scores (0..1) read as they
// are and a negative cosine or a raw logit still fits.
function barScale(scores) {
  const lo = Math.min(0, ...scores);
  const hi = Math.max(1, ...scores);
  return (s) => (s - lo) / (hi - lo);
}

function rankRow(result, text, scale, best) {
  const row = document.createElement("li");
  row.className = "rank" + (best ? " best" : "");
  row.dataset.index = String(result.index);
  row.dataset.score = String(result.relevance_score);
  const index = document.createElement("span");
  index.className = "index";
  index.textContent = `#${result.index}`;
  index.title = "its position among the documents sent";
  const doc = document.createElement("span");
  doc.className = "doc";
  doc.textContent = text;
  const score = document.createElement("span");
  score.className = "score";
  score.textContent = result.relevance_score.toFixed(3);
  const track = document.createElement("span");
  track.className = "track";
  const fill = document.createElement("span");
  fill.style.width = `${(100 * scale(result.relevance_score)).toFixed(1)}%`;
  track.append(fill);
  row.append(index, doc, score, track);
  return row;
}

async function runRerank() {
  clearRerank();
  const documents = rerankDocuments();
  const body = { model: rerankModelField(), query: $("rerank-query").value, documents, return_documents: false };
  const answer = await api("POST", "v1/rerank", body);
  const scale = barScale(answer.results.map((r) => r.relevance_score));
  $("rerank-output").replaceChildren(...answer.results.map((r, i) => rankRow(r, documents[r.index], scale, i === 0)));
  $("rerank-meta").textContent =
    `scored by ${answer.scored_by} · ${answer.usage.total_tokens} tokens · ${answer.model}`;
  $("rerank-meta").dataset.scoredBy = answer.scored_by;
}

function clearRerank() {
  $("rerank-output").replaceChildren();
  $("rerank-meta").textContent = "";
  delete $("rerank-meta").dataset.scoredBy;
}

function initRerank() {
  document.addEventListener("tserve:model", clearRerank);
  $("rerank-form").addEventListener("submit", (e) => { e.preventDefault(); guarded($("rerank-run"), runRerank); });
}

document.addEventListener("DOMContentLoaded", initRerank);
