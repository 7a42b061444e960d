// tserve playground, the chat view: a conversation with a model that has a chat template, through
// POST /v1/chat/completions (OpenAI's shape, streamed). Every turn resends the whole conversation, as clients do;
// reasoning (reasoning_content) is shown folded and not resent. Shares $, headers, errorText, readEvents and
// fillAdapters with playground.js. No build step, no deps.
"use strict";

const chat = { models: [], messages: [], abort: null };

// ---- models and adapters -----------------------------------------------------------------------

// The served models that have a chat template (GET /v1/models' chat_template), into the chat's own picker.
async function listChatModels(models) {
  chat.models = models.filter((m) => m.chat_template === true);
  const select = $("chat-model");
  const keep = select.value;
  select.replaceChildren(...chat.models.map((m) => new Option(m.name, m.name)));
  $("chat-send").disabled = !chat.models.length;
  if (!chat.models.length) {
    $("chat-meta").textContent = "";
    showChatError("No model served here has a chat template (an instruct model's chat_template in its " +
      "tokenizer_config.json, or chat_template.jinja beside it).");
    return;
  }
  showChatError("");
  const wanted = new URLSearchParams(location.search).get("model");
  const pick = [keep, wanted].find((name) => chat.models.some((m) => m.name === name));
  if (pick) select.value = pick;
  await chatModelChanged();
}

async function chatModelChanged() {
  const m = chat.models.find((x) => x.name === $("chat-model").value);
  $("chat-max").max = m.max_new_tokens || 256;
  $("chat-meta").textContent = `≤ ${m.max_input_tokens} tokens of conversation · tool calls: ` +
    `${m.tool_call_format || "none"}`;
  await fillAdapters($("chat-adapter"), m);
}

// OpenAI's model field: the model, or model:adapter.
function chatModelField() {
  const adapter = $("chat-adapter").value;
  return adapter ? `${$("chat-model").value}:${adapter}` : $("chat-model").value;
}

// ---- the conversation -------------------------------------------------------------------------

function showChatError(text) {
  $("chat-error").textContent = text;
}

function messageItem(role, text) {
  const item = document.createElement("li");
  item.className = `msg ${role}`;
  item.dataset.role = role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  item.append(who, content);
  $("chat-log").append(item);
  return item;
}

// An assistant's reply as it streams: its reasoning (folded, shown only if any), content, tool calls (JSON).
function replyItem() {
  const item = messageItem("assistant", "");
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "reasoning";
  const thought = document.createElement("div");
  thought.className = "reasoning-text";
  reasoning.append(summary, thought);
  item.querySelector(".content").before(reasoning);
  const tools = document.createElement("pre");
  tools.className = "tool-calls";
  tools.hidden = true;
  item.append(tools);
  return item;
}

function requestMessages(user) {
  const system = $("chat-system").value.trim();
  return [...(system ? [{ role: "system", content: system }] : []), ...chat.messages, user];
}

// One streamed tool-call delta into the calls so far: OpenAI sends a call's id and name first, then its
// arguments in pieces, each delta naming the call by index.
function mergeToolCall(calls, delta) {
  const call = calls[delta.index] ||= { id: "", type: "function", function: { name: "", arguments: "" } };
  if (delta.id) call.id = delta.id;
  if (delta.type) call.type = delta.type;
  if (delta.function?.name) call.function.name += delta.function.name;
  if (delta.function?.arguments) call.function.arguments += delta.function.arguments;
}

// POST the conversation with stream=true and draw the reply into item as its chunks arrive.
async function streamChat(messages, item, signal) {
  const body = {
    model: chatModelField(),
    messages,
    max_tokens: Number($("chat-max").value),
    temperature: Number($("chat-temp").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  const response = await fetch("v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
    signal });
  if (!response.ok) throw new Error(await errorText(response));
  const content = item.querySelector(".content");
  const reasoning = item.querySelector(".reasoning");
  const tools = item.querySelector(".tool-calls");
  const reply = { content: "", reasoning: "", toolCalls: [], finishReason: null, usage: null, firstMs: null };
  const started = performance.now();
  await readEvents(response, (chunk) => {
    if (chunk.usage) reply.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (reply.firstMs === null && (delta.content || delta.reasoning_content || delta.tool_calls)) {
        reply.firstMs = performance.now() - started;
      }
      if (delta.reasoning_content) {
        reply.reasoning += delta.reasoning_content;
        reasoning.hidden = false;
        reasoning.querySelector(".reasoning-text").textContent = reply.reasoning;
      }
      if (delta.content) {
        reply.content += delta.content;
        content.textContent = reply.content;
      }
      if (delta.tool_calls) {
        for (const call of delta.tool_calls) mergeToolCall(reply.toolCalls, call);
        tools.hidden = false;
        tools.textContent = JSON.stringify(reply.toolCalls, null, 2);
      }
      if (choice.finish_reason) reply.finishReason = choice.finish_reason;
    }
  });
  return reply;
}

function replyMeta(reply, seconds) {
  const tokens = reply.usage ? `${reply.usage.completion_tokens} tokens · ` : "";
  const first = reply.firstMs === null ? "" : ` · first token ${reply.firstMs.toFixed(0)} ms`;
  return `${tokens}${reply.finishReason || "no finish reason"}${first} · ${seconds.toFixed(2)} s`;
}

async function sendChat() {
  const text = $("chat-input").value;
  if (!text.trim() || chat.abort || !chat.models.length) return;
  showChatError("");
  const user = { role: "user", content: text };
  const messages = requestMessages(user);
  const userItem = messageItem("user", text);
  const item = replyItem();
  $("chat-input").value = "";
  $("chat-send").disabled = true;
  const abort = new AbortController();
  chat.abort = abort;
  const started = performance.now();
  try {
    const reply = await streamChat(messages, item, abort.signal);
    const answer = { role: "assistant", content: reply.content };
    if (reply.toolCalls.length) answer.tool_calls = reply.toolCalls;
    chat.messages.push(user, answer);
    item.dataset.done = "true";
    item.dataset.finishReason = reply.finishReason || "";
    $("chat-meta").textContent = replyMeta(reply, (performance.now() - started) / 1000);
  } catch (err) {
    if (abort.signal.aborted) return;  // "new chat" during the reply: the conversation is gone already
    userItem.remove();
    item.remove();
    if (!$("chat-input").value) $("chat-input").value = text;  // to send again
    showChatError(err.message);
  } finally {
    if (chat.abort === abort) chat.abort = null;
    $("chat-send").disabled = !chat.models.length;
  }
}

function newChat() {
  if (chat.abort) chat.abort.abort();
  chat.abort = null;
  chat.messages = [];
  $("chat-log").replaceChildren();
  showChatError("");
  $("chat-send").disabled = !chat.models.length;
  $("chat-input").focus();
}

// ---- wiring -----------------------------------------------------------------------------------

function initChat() {
  document.addEventListener("tserve:models", (e) => listChatModels(e.detail).catch((err) => showChatError(err.message)));
  $("chat-model").addEventListener("change", () => chatModelChanged().catch((err) => showChatError(err.message)));
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); sendChat(); });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-new").addEventListener("click", newChat);
}

document.addEventListener("DOMContentLoaded", initChat);
