// The playground: chats through the public API (/v1/chat/completions, streamed) and
// colours each piece of the answer by where it came from, using the per-round
// `speculation` extra of the stream chunks (docs/api.md). Model output only ever goes
// into textContent: it is shown as text, never parsed as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_ITEM = "specserve-api-key";
  const state = { key: sessionStorage.getItem(KEY_ITEM) || "", model: null, panes: [], busy: false };

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (state.key) h.Authorization = "Bearer " + state.key;
    return h;
  }

  function setStatus(text) { $("status").textContent = text; }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function askKey(message) {
    $("key-box").hidden = false;
    $("key-error").textContent = message || "";
    $("api-key").focus();
  }

  async function loadModels() {
    let reply;
    try {
      reply = await fetch("/v1/models", { headers: headers() });
    } catch (err) {
      setStatus("cannot reach the server: " + err);
      return;
    }
    if (reply.status === 401) {
      askKey(state.key ? "That key was refused." : "");
      return;
    }
    if (!reply.ok) {  // 503 while the models load
      setStatus("waiting for the server (/v1/models answered " + reply.status + ")");
      setTimeout(loadModels, 2000);
      return;
    }
    const card = (await reply.json()).data[0];
    const meta = card.metadata || {};
    state.model = card.id;
    $("key-box").hidden = true;
    $("model").textContent = card.id + " · default drafter " + (meta.default_drafter || "none");
    const sampling = meta.sampling_defaults;
    if (sampling) {  // what an API request that sends no temperature gets (this page sends one)
      $("sampling").textContent = "API requests that set none sample at temperature "
        + sampling.temperature + ", top_p " + sampling.top_p
        + (sampling.top_k ? ", top_k " + sampling.top_k : "") + " (" + sampling.source + ")";
    }
    const select = $("drafter");
    select.replaceChildren();
    for (const name of meta.drafters || []) {
      if (name === "none") continue;
      const option = el("option", "", name);
      option.value = name;
      option.selected = name === meta.default_drafter;
      select.append(option);
    }
    setStatus("");
    $("send").disabled = false;
  }

  class Pane {
    constructor(title, speculation) {
      this.speculation = speculation;  // null: follow the checkbox
      this.messages = [];
      this.root = el("section", "pane");
      this.root.dataset.speculation = speculation === false ? "off" : "on";
      this.root.append(el("h2", "", title));
    }

    request(text) {
      const on = this.speculation === null ? $("speculation").checked : this.speculation;
      const speculation = on ? { enabled: true, drafter: $("drafter").value || null }
        : { enabled: false };
      const body = {
        model: state.model, stream: true, stream_options: { include_usage: true },
        messages: [...this.messages, { role: "user", content: text }],
        max_tokens: Number($("max-tokens").value) || 128,
        temperature: Number($("temperature").value) || 0, speculation,
      };
      const predicted = $("prediction").value;
      if (on && predicted) body.prediction = { type: "content", content: predicted };
      return body;
    }

    async ask(text) {
      const turn = el("div", "turn");
      const answer = el("div", "answer");
      const figures = el("div", "figures");
      const details = el("details");
      const table = el("table");
      table.append(row("th", ["round", "source", "drafted", "accepted", "tokens", "draft ms",
        "verify ms"]));
      details.append(el("summary", "", "per round"), table);
      turn.append(el("div", "user", text), answer, figures, details);
      this.root.append(turn);
      const run = new Run(answer, figures, table);
      const body = this.request(text);
      try {
        await run.stream(body);
      } finally {
        answer.dataset.done = "true";
      }
      this.messages.push({ role: "user", content: text },
        { role: "assistant", content: run.text });
    }
  }

  function row(cell, values) {
    const tr = el("tr");
    for (const v of values) tr.append(el(cell, "", String(v)));
    return tr;
  }

  class Run {
    constructor(answer, figures, table) {
      Object.assign(this, { answer, figures, table });
      this.text = "";
      this.tokens = 0;
      this.predicted = null;  // the prediction's tokens the answer holds (usage)
      this.totals = null;
      this.ttft = null;
    }

    async stream(body) {
      this.start = performance.now();
      const reply = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body) });
      if (!reply.ok) {
        const error = await reply.json().catch(() => null);
        if (reply.status === 401) askKey("The server asks for an API key.");
        throw this.fail((error && error.error && error.error.message) || reply.statusText);
      }
      const reader = reply.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, end).replace(/\r$/, "");
          buffer = buffer.slice(end + 1);
          if (line.startsWith("data: ")) this.event(line.slice(6));
        }
      }
      this.show();
    }

    fail(message) {
      this.answer.append(el("span", "error", "error: " + message));
      return new Error(message);
    }

    event(data) {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw this.fail(chunk.error.message);
      if (chunk.usage) {  // the answer's tokens: a prediction's rejected ones are billed apart
        const details = chunk.usage.completion_tokens_details || {};
        this.tokens = chunk.usage.completion_tokens - (details.rejected_prediction_tokens || 0);
        this.predicted = details.accepted_prediction_tokens;
      }
      const speculation = chunk.speculation;
      if (speculation) this.totals = speculation;
      const round = speculation && speculation.round;
      if (round) {
        if (!chunk.usage) this.tokens += round.tokens;
        this.table.append(row("td", [round.index, round.source, round.draft_tokens,
          round.accepted_tokens, round.tokens, round.draft_ms.toFixed(1),
          round.verify_ms.toFixed(1)]));
      }
      const choice = chunk.choices && chunk.choices[0];
      const content = choice && choice.delta && choice.delta.content;
      if (content) {
        if (this.ttft === null) this.ttft = performance.now() - this.start;
        this.append(content, round ? round.spans : [], round ? round.index : -1);
        this.text += content;
      }
      this.show();
    }

    // The chunk's text, cut into spans by origin ([code points, origin], in order).
    append(content, spans, index) {
      const chars = Array.from(content);
      let at = 0;
      for (const [count, origin] of spans) {
        this.piece(chars.slice(at, at + count).join(""), origin, index);
        at += count;
      }
      if (at < chars.length) this.piece(chars.slice(at).join(""), "target", index);
    }

    piece(text, origin, index) {
      if (!text) return;
      const span = el("span", "tok", text);
      span.dataset.origin = origin;
      span.title = "round " + index + ": " + origin;
      this.answer.append(span);
    }

    show() {
      const t = this.totals || {};
      const seconds = (performance.now() - this.start) / 1000;
      const figures = [
        ["rounds", t.rounds ?? 0], ["drafted", t.draft_tokens ?? 0],
        ["accepted", t.accepted_tokens ?? 0],
        ["acceptance", t.acceptance_rate == null ? "-" : Math.round(t.acceptance_rate * 100) + "%"],
        ["tokens", this.tokens],
        ["tokens/round", t.rounds ? (this.tokens / t.rounds).toFixed(2) : "-"],
        ["tok/s", seconds > 0 ? (this.tokens / seconds).toFixed(1) : "-"],
        ["TTFT", this.ttft === null ? "-" : Math.round(this.ttft) + " ms"],
      ];
      if (this.predicted != null) figures.push(["prediction tokens in the answer", this.predicted]);
      this.figures.replaceChildren();
      for (const [name, value] of figures) {
        const item = el("span", "figure", name + " ");
        item.dataset.name = name;
        item.append(el("b", "", String(value)));
        this.figures.append(item);
      }
    }
  }

  function buildPanes() {
    state.panes = $("compare").checked
      ? [new Pane("speculation on", true), new Pane("speculation off", false)]
      : [new Pane("chat", null)];
    $("panes").replaceChildren(...state.panes.map((p) => p.root));
  }

  async function send(event) {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.busy || !state.model) return;
    state.busy = true;
    $("send").disabled = true;
    $("prompt").value = "";
    setStatus("");
    try {
      for (const pane of state.panes) await pane.ask(text);  // one after the other: fair timing
    } catch (err) {
      setStatus(String(err.message || err));
    } finally {
      state.busy = false;
      $("send").disabled = false;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("send").disabled = true;
    $("ask").addEventListener("submit", send);
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) send(e);
    });
    $("compare").addEventListener("change", buildPanes);
    $("clear").addEventListener("click", buildPanes);
    $("key-save").addEventListener("click", () => {
      state.key = $("api-key").value.trim();
      sessionStorage.setItem(KEY_ITEM, state.key);
      loadModels();
    });
    buildPanes();
    loadModels();
  });
})();
