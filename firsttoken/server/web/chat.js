// The chat page: a conversation streamed from /v1/chat/completions, each reply with its time to
// first token as this page saw it, the server's stages of it, cached prompt tokens and decode
// speed; a chart of the last replies' TTFTs; and the controls (model, system prompt and its
// pin, sampling, stop, clear, API key).

import { Api, ApiError } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { sseBatches } from "./sse.js";
import { TtftChart, formatMs } from "./ttft_chart.js";

const API_KEY_STORAGE = "firsttoken.apiKey";
const NARROW_SCREEN = "(max-width: 720px)";
const STAGES = [
  ["tokenize", "tokenize_s"],
  ["queue", "queue_s"],
  ["prefill", "prefill_s"],
  ["handoff", "first_token_handoff_s"],
];

const $ = (id) => document.getElementById(id);
const page = {
  model: $("model"),
  status: $("status"),
  settings: $("settings"),
  apiKeyForm: $("api-key-form"),
  apiKey: $("api-key"),
  systemPrompt: $("system-prompt"),
  pin: $("pin"),
  pinStatus: $("pin-status"),
  temperature: $("temperature"),
  maxTokens: $("max-tokens"),
  conversation: $("conversation"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  clear: $("clear"),
};

const api = new Api(() => page.apiKey.value.trim());
const chart = new TtftChart($("ttft-chart"), $("ttft-summary"));
// The conversation as sent to the server: user and assistant turns that got an answer.
const history = [];
let running = null; // the AbortController of the reply being streamed
let conversationNumber = 0; // counts clears: a reply that outlives its conversation is not kept
let pinned = null; // the server's pin of the system prompt, while the toggle is on

function showStatus(text) {
  page.status.textContent = text;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- models and the API key --------------------------------------------------------------------

async function loadModels() {
  showStatus("Loading models…");
  try {
    const names = await api.models();
    page.model.replaceChildren(...names.map((name) => new Option(name, name)));
    showStatus("");
  } catch (error) {
    page.model.replaceChildren();
    if (error instanceof ApiError && error.status === 401) {
      showStatus("This server needs an API key: enter it under Settings.");
      page.settings.open = true;
      page.apiKey.focus();
    } else {
      showStatus(`Could not list the models: ${error.message}`);
    }
  }
}

// Enter in the field both changes and submits it: the second call finds nothing new.
function saveApiKey() {
  const key = page.apiKey.value.trim();
  if (key === (localStorage.getItem(API_KEY_STORAGE) || "")) return;
  if (key) localStorage.setItem(API_KEY_STORAGE, key);
  else localStorage.removeItem(API_KEY_STORAGE);
  loadModels();
}

// -- the system prompt's pin -------------------------------------------------------------------

async function togglePin() {
  page.pin.disabled = true;
  try {
    if (page.pin.checked) await pinSystemPrompt();
    else await unpinSystemPrompt();
  } finally {
    page.pin.disabled = false;
  }
}

async function pinSystemPrompt() {
  const systemPrompt = page.systemPrompt.value.trim();
  if (!systemPrompt) {
    page.pin.checked = false;
    page.pinStatus.textContent = "Write a system prompt to pin.";
    return;
  }
  page.pinStatus.textContent = "Pinning…";
  try {
    pinned = await api.pin(systemPrompt);
  } catch (error) {
    page.pin.checked = false;
    page.pinStatus.textContent = error.message;
    return;
  }
  // Editing a pinned prompt would silently stop it matching the pin.
  page.systemPrompt.readOnly = true;
  page.pinStatus.textContent = `Pinned: ${pinned.num_tokens} tokens stay cached (${pinned.id}). Unpin to edit.`;
}

async function unpinSystemPrompt() {
  try {
    await api.unpin(pinned.id);
  } catch (error) {
    // 404: the server no longer holds it (it restarted); anything else: it is still pinned.
    if (!(error instanceof ApiError && error.status === 404)) {
      page.pin.checked = true;
      page.pinStatus.textContent = error.message;
      return;
    }
  }
  pinned = null;
  page.systemPrompt.readOnly = false;
  page.pinStatus.textContent = "";
}

// -- one reply ---------------------------------------------------------------------------------

// The list item of one message, and the body its text is rendered into.
function addMessage(role, text) {
  const item = element("li", `message ${role}`);
  item.append(element("div", "role", role === "user" ? "You" : "Assistant"));
  const body = element("div", "body");
  if (text) body.append(renderMarkdown(text));
  item.append(body);
  page.conversation.append(item);
  item.scrollIntoView({ block: "end" });
  return { item, body };
}

function requestBody() {
  const messages = [];
  const systemPrompt = page.systemPrompt.value.trim();
  if (systemPrompt) messages.push({ role: "system", content: systemPrompt });
  return {
    model: page.model.value || undefined,
    messages: messages.concat(history),
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(page.temperature.value),
    max_completion_tokens: Number(page.maxTokens.value),
  };
}

// What one reply's stream brought: its text, and the times (performance.now() ms) of its start,
// first shown token and latest token.
class ReplyStream {
  constructor(sentAt) {
    this.sentAt = sentAt;
    this.text = "";
    this.firstShownAt = null;
    this.lastTokenAt = null;
    this.usage = null;
    this.stages = null;
  }

  // Folds a batch of chunks in; true if the text grew.
  absorb(chunks) {
    const before = this.text.length;
    for (const chunk of chunks) {
      if (chunk.error) throw new ApiError(chunk.error.message, 0);
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) this.text += choice.delta.content;
      if (chunk.usage) this.usage = chunk.usage;
      if (chunk.firsttoken && chunk.firsttoken.choices.length) this.stages = chunk.firsttoken.choices[0];
    }
    return this.text.length > before;
  }

  markShown(now) {
    if (this.firstShownAt === null) this.firstShownAt = now;
    this.lastTokenAt = now;
  }

  get ttftMs() {
    return this.firstShownAt === null ? null : this.firstShownAt - this.sentAt;
  }

  // Tokens after the first, over the time from the first shown to the last.
  get decodeTokensPerS() {
    if (!this.usage || this.usage.completion_tokens < 2) return null;
    const seconds = (this.lastTokenAt - this.firstShownAt) / 1000;
    return seconds > 0 ? (this.usage.completion_tokens - 1) / seconds : null;
  }
}

async function send() {
  const text = page.prompt.value.trim();
  if (!text || running) return;
  if (!page.temperature.reportValidity() || !page.maxTokens.reportValidity()) return;
  const conversation = conversationNumber;
  page.prompt.value = "";
  addMessage("user", text);
  history.push({ role: "user", content: text });
  const body = requestBody();
  const reply = addMessage("assistant");
  reply.item.classList.add("streaming");
  const controller = new AbortController();
  setRunning(controller);
  const stream = new ReplyStream(performance.now());
  try {
    const response = await api.streamChat(body, controller.signal);
    for await (const chunks of sseBatches(response.body)) {
      if (!stream.absorb(chunks)) continue;
      reply.body.replaceChildren(renderMarkdown(stream.text));
      stream.markShown(performance.now());
    }
    showReplyStats(reply.item, stream, performance.now() - stream.sentAt);
  } catch (error) {
    if (error.name === "AbortError") {
      reply.item.append(element("p", "note", "Stopped."));
      if (stream.ttftMs !== null) showReplyStats(reply.item, stream, performance.now() - stream.sentAt);
    } else {
      reply.item.append(element("p", "error", error.message));
    }
  } finally {
    reply.item.classList.remove("streaming");
    setRunning(null);
  }
  if (conversation !== conversationNumber) return;
  if (stream.text) history.push({ role: "assistant", content: stream.text });
  else history.pop(); // unanswered: the next message is sent without it
  page.prompt.focus();
}

function setRunning(controller) {
  running = controller;
  page.send.disabled = controller !== null;
  page.stop.disabled = controller === null;
}

// The reply's figures under it, also kept as data-* attributes of its item.
function showReplyStats(item, stream, totalMs) {
  const ttftMs = stream.ttftMs;
  if (ttftMs === null) return;
  chart.add(ttftMs);
  item.dataset.ttftMs = ttftMs.toFixed(1);
  item.dataset.totalMs = totalMs.toFixed(1);
  const stats = element("div", "stats");
  const figures = [`TTFT ${formatMs(ttftMs)}`];
  if (stream.stages) {
    const serverMs = (stream.stages.ttft_s || 0) * 1000;
    item.dataset.serverTtftMs = serverMs.toFixed(2);
    figures.push(`server ${formatMs(serverMs)}`);
    stats.append(stageBar(stream.stages, ttftMs));
  }
  if (stream.usage) {
    const cached = stream.usage.prompt_tokens_details.cached_tokens;
    item.dataset.cachedTokens = String(cached);
    item.dataset.promptTokens = String(stream.usage.prompt_tokens);
    figures.push(`${cached}/${stream.usage.prompt_tokens} prompt tokens cached`);
  }
  const tokensPerS = stream.decodeTokensPerS;
  if (tokensPerS !== null) {
    item.dataset.decodeTokensPerS = tokensPerS.toFixed(1);
    figures.push(`${tokensPerS.toFixed(1)} tokens/s`);
  }
  stats.prepend(element("p", "figures", figures.join(" · ")));
  item.append(stats);
}

// The TTFT as a stacked bar: the server's stages, then what the network and this page added.
function stageBar(stages, ttftMs) {
  const parts = STAGES.map(([name, field]) => [name, (stages[field] || 0) * 1000]);
  const serverMs = parts.reduce((sum, [, ms]) => sum + ms, 0);
  parts.push(["rest", Math.max(0, ttftMs - serverMs)]);
  const bar = element("div", "stage-bar");
  bar.setAttribute("role", "img");
  const described = parts.map(([name, ms]) => `${name === "rest" ? "network and page" : name} ${formatMs(ms)}`);
  bar.setAttribute("aria-label", described.join(", "));
  parts.forEach(([name, ms], index) => {
    const segment = element("span", `stage stage-${name}`);
    segment.style.flexGrow = String(ms);
    segment.title = described[index];
    segment.dataset.stage = name;
    segment.dataset.ms = ms.toFixed(3);
    bar.append(segment);
  });
  return bar;
}

function stop() {
  if (running) running.abort();
}

function clearConversation() {
  stop();
  conversationNumber += 1;
  history.length = 0;
  page.conversation.replaceChildren();
  page.prompt.focus();
}

// -- wiring ------------------------------------------------------------------------------------

page.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
page.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  } else if (event.key === "Escape") {
    stop();
  }
});
page.stop.addEventListener("click", stop);
page.clear.addEventListener("click", clearConversation);
page.pin.addEventListener("change", togglePin);
page.apiKey.addEventListener("change", saveApiKey);
page.apiKeyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  saveApiKey();
});

page.apiKey.value = localStorage.getItem(API_KEY_STORAGE) || "";
if (window.matchMedia(NARROW_SCREEN).matches) page.settings.open = false;
loadModels();
page.prompt.focus();
