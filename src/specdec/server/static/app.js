// specdec's chat page: talks to this server's own OpenAI endpoints and shows speculation at work.
// Model text and imported conversations reach the page only through textContent / text nodes
// (markdown.js builds its nodes the same way); the server's CSP forbids inline script anyway.
"use strict";

(function () {
  const STORE = "specdec.conversations.v1";
  const SETTINGS = "specdec.settings.v1";
  const KEY = "specdec.apiKey"; // sessionStorage: this tab only
  const SOURCES = ["draft", "target", "bonus"];
  const SOURCE_NAMES = { draft: "accepted draft token", target: "the target's own token", bonus: "bonus token" };
  const $ = (id) => document.getElementById(id);

  const S = {
    model: null, chat: true, drafters: [], defaultDrafter: "",
    conversations: [], current: null, controller: null, busy: false,
    keyPrompt: null, // the pending key dialog's promise, so parallel 401s ask once
  };

  // -- small helpers ----------------------------------------------------------------------------

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  const str = (v) => (typeof v === "string" ? v : "");
  const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);
  const nums = (v) => (Array.isArray(v) ? v.map((x) => num(x) || 0) : []);
  const fmt = (v, digits) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
  const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

  function showError(text) {
    $("error").textContent = text || "";
  }

  // -- API key and requests ---------------------------------------------------------------------

  function askKey(why) {
    if (S.keyPrompt) return S.keyPrompt;
    S.keyPrompt = new Promise((resolve, reject) => {
      const dialog = $("key-dialog");
      const input = $("key-input");
      $("key-why").textContent = why;
      input.value = "";
      function done(ok) {
        $("key-form").removeEventListener("submit", onSubmit);
        dialog.removeEventListener("cancel", onCancel);
        if (dialog.open) dialog.close();
        S.keyPrompt = null;
        if (ok) resolve(input.value.trim());
        else reject(new Error("an API key is needed to talk to this server"));
      }
      function onSubmit(event) {
        event.preventDefault();
        if (input.value.trim()) done(true);
      }
      function onCancel(event) {
        event.preventDefault();
        done(false);
      }
      $("key-form").addEventListener("submit", onSubmit);
      dialog.addEventListener("cancel", onCancel);
      dialog.showModal();
      input.focus();
    });
    return S.keyPrompt;
  }

  // fetch with the tab's key; a 401 asks for a key (again, if the one kept was refused) and retries.
  async function api(path, options) {
    for (;;) {
      const headers = Object.assign({}, options.headers || {});
      const key = sessionStorage.getItem(KEY);
      if (key) headers.Authorization = "Bearer " + key;
      const res = await fetch(path, Object.assign({}, options, { headers: headers }));
      if (res.status !== 401) return res;
      const why = key ? "The server refused that key. Enter another one."
        : "This server needs an API key. It is kept for this tab only (sessionStorage).";
      sessionStorage.setItem(KEY, await askKey(why));
    }
  }

  async function errorText(res) {
    try {
      const body = await res.json();
      if (body && body.error && typeof body.error.message === "string") return res.status + ": " + body.error.message;
    } catch (e) { /* not JSON */ }
    return "HTTP " + res.status;
  }

  async function loadModels() {
    let res;
    try {
      res = await api("/v1/models", {});
    } catch (e) {
      $("model-line").textContent = "Not connected: " + e.message;
      return;
    }
    if (!res.ok) {
      $("model-line").textContent = "Not connected: " + (await errorText(res));
      return;
    }
    const model = (await res.json()).data[0];
    const ext = model.specdec;
    if (!ext) { // the server is still loading its model, or failed to
      const health = await fetch("/health").then((r) => r.json()).catch(() => ({}));
      if (health.status === "error") {
        $("model-line").textContent = "The model failed to load: " + str(health.error);
        return;
      }
      $("model-line").textContent = "The model " + model.id + " is loading…";
      setTimeout(loadModels, 2000);
      return;
    }
    S.model = model.id;
    S.chat = !!ext.chat_template;
    S.drafters = (ext.drafters || []).filter((d) => d !== "none");
    S.defaultDrafter = ext.default_drafter || "";
    $("model-line").textContent = "Model " + model.id + (S.chat ? " (chat)" :
      " (no chat template: each message continues the text, through /v1/completions)") +
      "; drafter " + S.defaultDrafter;
    fillDrafters();
  }

  function fillDrafters() {
    const select = $("drafter");
    const wanted = loadSettings().drafter || "";
    select.replaceChildren(el("option", null, "server default (" + S.defaultDrafter + ")"));
    select.firstChild.value = "";
    for (const name of S.drafters) {
      const option = el("option", null, name);
      option.value = name;
      select.appendChild(option);
    }
    select.value = S.drafters.includes(wanted) ? wanted : "";
  }

  // -- settings ---------------------------------------------------------------------------------

  const FIELDS = ["system", "temperature", "max-tokens", "drafter", "prediction", "tools", "extra"];
  const CHECKS = ["speculate", "colours", "compare"];

  function loadSettings() {
    try {
      return JSON.parse(localStorage.getItem(SETTINGS)) || {};
    } catch (e) {
      return {};
    }
  }

  function saveSettings() {
    const out = {};
    for (const id of FIELDS) out[id] = $(id).value;
    for (const id of CHECKS) out[id] = $(id).checked;
    localStorage.setItem(SETTINGS, JSON.stringify(out));
    $("legend").hidden = !$("colours").checked;
  }

  function restoreSettings() {
    const saved = loadSettings();
    for (const id of FIELDS) if (typeof saved[id] === "string" && id !== "drafter") $(id).value = saved[id];
    for (const id of CHECKS) if (typeof saved[id] === "boolean") $(id).checked = saved[id];
    $("legend").hidden = !$("colours").checked;
  }

  function parseJson(id, what, kind) {
    const text = $(id).value.trim();
    if (!text) return null;
    let value;
    try {
      value = JSON.parse(text);
    } catch (e) {
      throw new Error(what + " is not valid JSON: " + e.message);
    }
    if (kind === "array" ? !Array.isArray(value) : (typeof value !== "object" || value === null || Array.isArray(value))) {
      throw new Error(what + " must be a JSON " + kind);
    }
    return value;
  }

  // -- conversations ----------------------------------------------------------------------------

  function cleanStats(s) {
    if (!s || typeof s !== "object") return null;
    const out = {};
    for (const k of ["completion_tokens", "target_passes", "tokens_per_pass", "draft_tokens", "accepted_tokens",
      "acceptance_rate", "tokens_per_s", "ttft_s", "e2e_s"]) out[k] = num(s[k]);
    out.drafted_per_position = nums(s.drafted_per_position);
    out.accepted_per_position = nums(s.accepted_per_position);
    return out;
  }

  function cleanMessage(m) {
    if (!m || typeof m !== "object" || (m.role !== "user" && m.role !== "assistant")) return null;
    const out = { role: m.role, content: str(m.content) };
    if (Array.isArray(m.tokens)) {
      out.tokens = m.tokens.filter((t) => t && typeof t.text === "string")
        .map((t) => ({ text: t.text, source: SOURCES.includes(t.source) ? t.source : "none" }));
    }
    if (Array.isArray(m.tool_calls)) {
      out.tool_calls = m.tool_calls.filter((c) => c && typeof c === "object")
        .map((c) => ({ id: str(c.id), name: str(c.name), arguments: str(c.arguments) }));
    }
    const stats = cleanStats(m.stats);
    if (stats) out.stats = stats;
    if (m.plain && typeof m.plain === "object") {
      out.plain = { text: str(m.plain.text), stats: cleanStats(m.plain.stats), error: str(m.plain.error) };
    }
    for (const k of ["error", "finish"]) if (typeof m[k] === "string") out[k] = m[k];
    return out;
  }

  function cleanConversation(c) {
    if (!c || typeof c !== "object" || !Array.isArray(c.messages)) return null;
    return { id: newId(), title: str(c.title).slice(0, 200) || "Imported", created: num(c.created) || Date.now(),
      system: str(c.system), messages: c.messages.map(cleanMessage).filter(Boolean) };
  }

  function loadConversations() {
    let saved = [];
    try {
      saved = JSON.parse(localStorage.getItem(STORE)) || [];
    } catch (e) { /* a damaged store starts afresh */ }
    S.conversations = (Array.isArray(saved) ? saved : []).map(cleanConversation).filter(Boolean);
    if (!S.conversations.length) S.conversations.push(blankConversation());
    S.current = S.conversations[0].id;
  }

  function saveConversations() {
    try {
      localStorage.setItem(STORE, JSON.stringify(S.conversations));
    } catch (e) {
      showError("Could not save the conversations in this browser: " + e.message);
    }
  }

  function blankConversation() {
    return { id: newId(), title: "New conversation", created: Date.now(), system: "", messages: [] };
  }

  function current() {
    return S.conversations.find((c) => c.id === S.current) || S.conversations[0];
  }

  function renderConversationList() {
    const list = $("conversations");
    list.replaceChildren();
    for (const c of S.conversations) {
      const li = el("li");
      const open = el("button", "conv", c.title);
      open.type = "button";
      if (c.id === S.current) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => { if (!S.busy) { S.current = c.id; renderAll(); } });
      const del = el("button", "conv-delete", "×");
      del.type = "button";
      del.setAttribute("aria-label", "Delete conversation: " + c.title);
      del.addEventListener("click", () => deleteConversation(c.id));
      li.append(open, del);
      list.appendChild(li);
    }
  }

  function deleteConversation(id) {
    if (S.busy) return;
    S.conversations = S.conversations.filter((c) => c.id !== id);
    if (!S.conversations.length) S.conversations.push(blankConversation());
    if (!S.conversations.some((c) => c.id === S.current)) S.current = S.conversations[0].id;
    saveConversations();
    renderAll();
  }

  function exportConversations() {
    const blob = new Blob([JSON.stringify({ format: "specdec-chat", version: 1, conversations: S.conversations }, null, 2)],
      { type: "application/json" });
    const a = el("a");
    a.href = URL.createObjectURL(blob);
    a.download = "specdec-conversations.json";
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  function importConversations(file) {
    const reader = new FileReader();
    reader.onload = () => {
      let data;
      try {
        data = JSON.parse(String(reader.result));
      } catch (e) {
        $("import-status").textContent = "Not a JSON file: " + e.message;
        return;
      }
      const list = Array.isArray(data) ? data : Array.isArray(data && data.conversations) ? data.conversations : [data];
      const found = list.map(cleanConversation).filter(Boolean);
      if (!found.length) {
        $("import-status").textContent = "No conversation found in " + file.name;
        return;
      }
      S.conversations = found.concat(S.conversations.filter((c) => c.messages.length));
      S.current = found[0].id;
      saveConversations();
      renderAll();
      $("import-status").textContent = "Imported " + found.length + " conversation" + (found.length > 1 ? "s" : "");
    };
    reader.readAsText(file);
  }

  // -- rendering messages -----------------------------------------------------------------------

  function renderAll() {
    renderConversationList();
    const log = $("log");
    log.replaceChildren();
    current().messages.forEach((m, i) => log.appendChild(messageView(m, i)));
  }

  function messageView(m, index) {
    const article = el("article", "msg " + m.role);
    article.setAttribute("aria-label", (m.role === "user" ? "Message " : "Answer ") + (index + 1));
    const head = el("div", "msg-head");
    head.appendChild(el("span", "role", m.role === "user" ? "You" : "Model"));
    article.appendChild(head);
    if (m.role === "user") {
      article.appendChild(el("div", "body user-text", m.content));
      return article;
    }
    const toggle = el("button", "view-toggle", "Token sources");
    toggle.type = "button";
    head.appendChild(toggle);
    const formatted = el("div", "body markdown");
    const tokens = el("div", "body tokens");
    article.append(formatted, tokens, el("div", "calls"), el("div", "stats"), el("div", "plain"));
    let showTokens = $("colours").checked;
    function flip() {
      tokens.hidden = !showTokens;
      formatted.hidden = showTokens;
      toggle.setAttribute("aria-pressed", String(showTokens));
    }
    toggle.addEventListener("click", () => { showTokens = !showTokens; flip(); });
    flip();
    updateMessage(article, m);
    return article;
  }

  function updateMessage(article, m) {
    const [formatted, tokens, calls, stats, plain] = article.querySelectorAll(".body.markdown, .body.tokens, .calls, .stats, .plain");
    formatted.replaceChildren(window.SpecdecMarkdown.render(m.content));
    tokens.replaceChildren(tokenSpans(m));
    calls.replaceChildren(...(m.tool_calls || []).map(callView));
    if (m.error) calls.appendChild(el("p", "error", m.error));
    if (m.finish === "stopped") calls.appendChild(el("p", "muted", "Stopped."));
    stats.replaceChildren(...(m.stats ? statsView(m.stats) : []));
    plain.replaceChildren(...(m.plain ? plainView(m) : []));
  }

  function tokenSpans(m) {
    const out = document.createDocumentFragment();
    const parts = m.tokens && m.tokens.length ? m.tokens : m.content ? [{ text: m.content, source: "none" }] : [];
    for (const t of parts) {
      const span = el("span", "tok " + (SOURCES.includes(t.source) ? t.source : "none"), t.text);
      if (SOURCE_NAMES[t.source]) span.title = SOURCE_NAMES[t.source];
      out.appendChild(span);
    }
    return out;
  }

  function callView(call) {
    const box = el("div", "tool-call");
    box.appendChild(el("p", "tool-call-name", "Tool call: " + call.name));
    let args = call.arguments;
    try {
      args = JSON.stringify(JSON.parse(call.arguments), null, 2);
    } catch (e) { /* shown as sent */ }
    const pre = el("pre");
    pre.appendChild(el("code", null, args));
    box.appendChild(pre);
    return box;
  }

  function statsView(s) {
    const dl = el("dl", "stat-list");
    const add = (name, value) => dl.append(el("dt", null, name), el("dd", null, value));
    add("tokens/s", fmt(s.tokens_per_s, 1));
    add("tokens per target pass", fmt(s.tokens_per_pass, 2));
    add("draft tokens accepted", s.draft_tokens ? s.accepted_tokens + " / " + s.draft_tokens +
      " (" + fmt(100 * s.acceptance_rate, 0) + "%)" : "none drafted");
    add("first token", s.ttft_s === null ? "–" : fmt(s.ttft_s * 1000, 0) + " ms");
    const out = [dl];
    if (s.drafted_per_position.some((x) => x > 0)) out.push(acceptanceChart(s));
    return out;
  }

  // Acceptance at each draft position: accepted / reached, one bar per position.
  function acceptanceChart(s) {
    const rates = s.drafted_per_position.map((d, i) => (d ? s.accepted_per_position[i] / d : 0));
    const bar = 18, gap = 6, h = 60, top = 4, labels = 14;
    const width = rates.length * (bar + gap) + gap;
    const words = rates.map((r, i) => "position " + (i + 1) + ": " + Math.round(100 * r) + "%").join(", ");
    const chart = svg("svg", { width: width, height: h + top + labels, viewBox: "0 0 " + width + " " + (h + top + labels),
      role: "img", class: "chart", "aria-label": "Acceptance by draft position: " + words });
    const title = svg("title");
    title.textContent = "Acceptance by draft position: " + words;
    chart.appendChild(title);
    chart.appendChild(svg("line", { x1: 0, y1: top + h, x2: width, y2: top + h, class: "axis" }));
    rates.forEach((r, i) => {
      const x = gap + i * (bar + gap);
      chart.appendChild(svg("rect", { x: x, y: top + h * (1 - r), width: bar, height: Math.max(1, h * r), class: "bar" }));
      const label = svg("text", { x: x + bar / 2, y: top + h + labels - 2, "text-anchor": "middle", class: "chart-label" });
      label.textContent = String(i + 1);
      chart.appendChild(label);
    });
    const figure = el("figure", "chart-box");
    figure.append(chart, el("figcaption", "muted", "acceptance by draft position"));
    return figure;
  }

  function plainView(m) {
    const p = m.plain;
    if (p.error) return [el("p", "error", "Plain run: " + p.error)];
    const spec = m.stats && m.stats.tokens_per_s, plain = p.stats && p.stats.tokens_per_s;
    const line = "Plain decoding: " + fmt(plain, 1) + " tokens/s" +
      (spec && plain ? "; speculative " + fmt(spec / plain, 2) + "x" : "") +
      "; same text: " + (p.text === m.content ? "yes" : "no");
    const details = el("details", "plain-answer");
    details.appendChild(el("summary", null, "Plain answer"));
    details.appendChild(el("div", "user-text", p.text));
    return [el("p", "plain-line", line), details];
  }

  // -- sending ----------------------------------------------------------------------------------

  function requestFor(conv, upto, speculative, tokens) {
    const body = { model: S.model, stream: true, specdec: { tokens: tokens, stats: true } };
    const max = parseInt($("max-tokens").value, 10);
    if (max > 0) body.max_tokens = max;
    const temperature = parseFloat($("temperature").value);
    body.temperature = isFinite(temperature) ? temperature : 0;
    if (!speculative) body.speculative = false;
    else if ($("drafter").value) body.speculative = { drafter: $("drafter").value };
    const prediction = $("prediction").value;
    if (prediction) body.prediction = { type: "content", content: prediction };
    const history = conv.messages.slice(0, upto);
    let path;
    if (S.chat) {
      path = "/v1/chat/completions";
      body.messages = (conv.system ? [{ role: "system", content: conv.system }] : []).concat(history.map(wireMessage));
      const tools = parseJson("tools", "Tools", "array");
      if (tools) body.tools = tools;
    } else {
      path = "/v1/completions";
      body.prompt = (conv.system ? conv.system + "\n\n" : "") + history.map((m) => m.content).join("");
    }
    Object.assign(body, parseJson("extra", "Extra request fields", "object") || {});
    return [path, body];
  }

  function wireMessage(m) {
    const out = { role: m.role, content: m.content };
    if (m.tool_calls && m.tool_calls.length) {
      out.tool_calls = m.tool_calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
    }
    return out;
  }

  // One streamed request; `onChunk(parsed)` per event. Resolves at [DONE] or the end of the body.
  async function stream(path, body, signal, onChunk) {
    const res = await api(path, { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: signal });
    if (!res.ok) throw new Error(await errorText(res));
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let at;
      while ((at = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, at);
        buffer = buffer.slice(at + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new Error(parsed.error.message || "the server reported an error");
        onChunk(parsed);
      }
    }
  }

  // Folds one chunk into message `m` (text, token sources, tool calls, statistics).
  function absorb(m, chunk) {
    const choice = (chunk.choices || [])[0];
    const ext = chunk.specdec || {};
    if (choice) {
      const text = S.chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
      m.content += text;
      if (ext.tokens) for (const t of ext.tokens) m.tokens.push({ text: str(t.text), source: str(t.source) });
      else if (text) m.tokens.push({ text: text, source: "none" });
      for (const call of (choice.delta && choice.delta.tool_calls) || []) {
        const at = call.index || 0;
        m.tool_calls = m.tool_calls || [];
        const slot = m.tool_calls[at] || (m.tool_calls[at] = { id: "", name: "", arguments: "" });
        if (call.id) slot.id = call.id;
        if (call.function && call.function.name) slot.name += call.function.name;
        if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
      }
      if (choice.finish_reason) m.finish = choice.finish_reason;
    }
    if (ext.stats) m.stats = cleanStats(ext.stats);
  }

  function setBusy(busy) {
    S.busy = busy;
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("log").setAttribute("aria-busy", String(busy));
  }

  async function send(text) {
    showError("");
    const conv = current();
    conv.system = $("system").value;
    if (!conv.messages.length) conv.title = text.slice(0, 60) || "New conversation";
    conv.messages.push({ role: "user", content: text });
    const m = { role: "assistant", content: "", tokens: [] };
    conv.messages.push(m);
    let request;
    try {
      request = requestFor(conv, conv.messages.length - 1, $("speculate").checked, true);
    } catch (e) {
      conv.messages.splice(-2, 2);
      showError(e.message);
      return;
    }
    renderAll();
    const article = $("log").lastChild;
    article.scrollIntoView({ block: "nearest" });
    setBusy(true);
    S.controller = new AbortController();
    let pending = false;
    const repaint = () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => { pending = false; updateMessage(article, m); });
    };
    const ok = await run(request, m, repaint);
    updateMessage(article, m);
    if (ok && $("compare").checked) {
      await plainRun(conv, m);
      updateMessage(article, m);
    }
    S.controller = null;
    setBusy(false);
    saveConversations();
    $("message").focus();
  }

  async function run([path, body], m, repaint) {
    try {
      await stream(path, body, S.controller.signal, (chunk) => { absorb(m, chunk); repaint(); });
      return true;
    } catch (e) {
      if (e.name === "AbortError") m.finish = "stopped";
      else m.error = e.message;
      return false;
    } finally {
      saveConversations();
    }
  }

  // The same request again with speculation off, after the first (so the two do not share the CPU).
  async function plainRun(conv, m) {
    const p = { role: "assistant", content: "", tokens: [] };
    let request;
    try {
      request = requestFor(conv, conv.messages.length - 1, false, false);
      delete request[1].prediction;
    } catch (e) {
      m.plain = { text: "", stats: null, error: e.message };
      return;
    }
    await run(request, p, () => {});
    m.plain = { text: p.content, stats: p.stats || null, error: p.error || (p.finish === "stopped" ? "stopped" : "") };
  }

  function stop() {
    if (S.controller) S.controller.abort();
  }

  // -- wiring -----------------------------------------------------------------------------------

  function init() {
    restoreSettings();
    loadConversations();
    renderAll();
    for (const id of FIELDS.concat(CHECKS)) $(id).addEventListener("change", saveSettings);
    $("colours").addEventListener("change", renderAll);
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("message").value;
      if (S.busy || !text.trim() || !S.model) return;
      $("message").value = "";
      send(text);
    });
    $("message").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    document.addEventListener("keydown", (event) => { if (event.key === "Escape" && S.busy) stop(); });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", () => {
      if (S.busy) return;
      const c = blankConversation();
      S.conversations.unshift(c);
      S.current = c.id;
      renderAll();
      $("message").focus();
    });
    $("export").addEventListener("click", exportConversations);
    $("import").addEventListener("change", (event) => {
      const file = event.target.files[0];
      if (file) importConversations(file);
      event.target.value = "";
    });
    if (window.matchMedia("(max-width: 700px)").matches) $("side-panel").open = false;
    loadModels();
  }

  document.addEventListener("DOMContentLoaded", init);
})();
