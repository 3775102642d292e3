// The council page: conversations on the left, the thread on the right. A running job is
// followed over SSE (fetch + a stream reader, since the start is a POST); after a reload the
// page asks job/status and replays the job from its first event, and a dropped connection
// resumes with ?after=<last event seen>. No build step, no dependencies.
"use strict";

(function () {
  const md = window.CouncilMarkdown;
  const esc = md.escapeHtml;
  const $ = (id) => document.getElementById(id);
  const STAGE_NOTES = {
    pending: "Starting…",
    stage1: "Council members are answering…",
    stage2: "Peer review in progress…",
    stage3: "The chairman is writing the final answer…",
  };

  let conversationId = null;
  let messages = []; // { role, content } | assistant view state (see newAssistant)
  let following = null; // AbortController of the live stream
  let drawPending = false;

  // --- the API ---------------------------------------------------------------------------------
  async function api(path, options) {
    const response = await fetch("api/" + path, options);
    if (!response.ok) {
      let message = response.status + " " + response.statusText;
      try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
      const error = new Error(message);
      error.status = response.status;
      throw error;
    }
    return response;
  }

  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) onEvent(JSON.parse(data));
      }
    }
  }

  // --- one assistant message's state, built from events or from the stored message -----------
  function newAssistant(jobId) {
    return {
      role: "assistant", jobId, status: "pending", lastSeq: 0, error: null, resumed: false,
      stage1: { models: [], text: {}, state: {}, errors: {}, tools: {}, tab: null },
      stage2: { models: [], text: {}, state: {}, errors: {}, parsed: {}, tab: null },
      labelToModel: {}, aggregate: [],
      stage3: { model: null, text: "", done: false, note: null },
    };
  }

  function fromStored(message) {
    const view = newAssistant(message.job_id);
    view.status = message.status || "complete";
    view.error = message.error;
    for (const r of message.stage1 || []) {
      view.stage1.models.push(r.model);
      view.stage1.text[r.model] = r.response;
      view.stage1.state[r.model] = "done";
    }
    const meta = message.metadata || {};
    for (const f of meta.failed_members || []) {
      view.stage1.models.push(f.model);
      view.stage1.state[f.model] = "failed";
      view.stage1.errors[f.model] = f.error;
    }
    for (const r of message.stage2 || []) {
      view.stage2.models.push(r.model);
      view.stage2.text[r.model] = r.ranking;
      view.stage2.parsed[r.model] = r.parsed_ranking;
      view.stage2.state[r.model] = "done";
    }
    view.labelToModel = meta.label_to_model || {};
    view.aggregate = meta.aggregate_rankings || [];
    if (message.stage3) {
      view.stage3 = { model: message.stage3.model, text: message.stage3.response, done: true,
        note: message.stage3.chairman_error || null };
    }
    return view;
  }

  function apply(view, e) {
    view.lastSeq = Math.max(view.lastSeq, e.seq || 0);
    const s1 = view.stage1, s2 = view.stage2;
    switch (e.type) {
      case "resumed": view.resumed = true; break;
      case "stage1_start":
        view.status = "stage1";
        Object.assign(s1, { models: e.models.slice(), text: {}, state: {}, errors: {}, tools: {} });
        for (const m of e.models) s1.state[m] = "running";
        break;
      case "stage1_chunk": s1.text[e.model] = (s1.text[e.model] || "") + e.text; break;
      case "stage1_tool": (s1.tools[e.model] = s1.tools[e.model] || []).push(e); break;
      case "stage1_member":
        if (e.ok) { s1.text[e.model] = e.response; s1.state[e.model] = "done"; }
        else { s1.state[e.model] = "failed"; s1.errors[e.model] = e.error; }
        break;
      case "stage2_start":
        view.status = "stage2";
        view.labelToModel = e.label_to_model;
        Object.assign(s2, { models: Object.values(e.label_to_model), text: {}, state: {}, errors: {}, parsed: {} });
        for (const m of s2.models) s2.state[m] = "running";
        break;
      case "stage2_chunk": s2.text[e.model] = (s2.text[e.model] || "") + e.text; break;
      case "stage2_member":
        if (e.ok) { s2.text[e.model] = e.ranking; s2.parsed[e.model] = e.parsed_ranking; s2.state[e.model] = "done"; }
        else { s2.state[e.model] = "failed"; s2.errors[e.model] = e.error; }
        break;
      case "stage2_complete": view.aggregate = e.aggregate_rankings; break;
      case "stage3_start": view.status = "stage3"; view.stage3 = { model: e.model, text: "", done: false, note: null }; break;
      case "stage3_chunk": view.stage3.text += e.text; break;
      case "stage3_complete":
        view.stage3 = { model: e.model, text: e.response, done: true, note: e.chairman_error || null };
        break;
      case "title_complete": loadConversations(); break;
      case "complete": view.status = "complete"; break;
      case "error": view.status = "error"; view.error = e.message; break;
    }
  }

  // --- drawing ---------------------------------------------------------------------------------
  function deanonymize(escapedText, labelToModel) {
    return escapedText.replace(/Response ([A-Z])\b/g, (label) =>
      labelToModel[label] ? "<strong>" + esc(labelToModel[label]) + "</strong>" : label);
  }

  function tabs(stage, key, view, body) {
    if (!stage.models.length) return "";
    if (!stage.tab || !stage.models.includes(stage.tab)) stage.tab = stage.models[0];
    const buttons = stage.models.map((m) =>
      '<button type="button" role="tab" class="tab ' + (stage.state[m] || "") + (m === stage.tab ? " active" : "") +
      '" data-stage="' + key + '" data-model="' + esc(m) + '" aria-selected="' + (m === stage.tab) + '">' +
      esc(m) + '<span class="dot" title="' + esc(stage.state[m] || "") + '"></span></button>').join("");
    return '<div class="tabs" role="tablist">' + buttons + '</div><div class="panel" role="tabpanel">' + body(stage.tab) + "</div>";
  }

  function drawAssistant(view) {
    const parts = [];
    if (view.resumed) parts.push('<p class="note">The proxy restarted during this job; it resumed after the last completed stage.</p>');
    const s1 = view.stage1;
    parts.push('<section class="stage" data-stage="1"><h3>Stage 1 · individual answers</h3>' + tabs(s1, "1", view, (m) => {
      if (s1.state[m] === "failed") return '<p class="error">' + esc(s1.errors[m]) + "</p>";
      const tools = (s1.tools[m] || []).map((t) => '<li><code>' + esc(t.name) + "</code> " + esc(t.arguments) + (t.ok ? "" : " (failed)") + "</li>").join("");
      return (tools ? '<ul class="tools">' + tools + "</ul>" : "") +
        '<div class="md">' + (md.render(s1.text[m] || "") || '<p class="muted">Thinking…</p>') + "</div>";
    }) + "</section>");
    const s2 = view.stage2;
    if (s2.models.length) {
      parts.push('<section class="stage" data-stage="2"><h3>Stage 2 · peer rankings</h3>' +
        '<p class="muted">Each model ranked the answers as Response A, B, …; names are shown here in bold for reading.</p>' +
        tabs(s2, "2", view, (m) => {
          if (s2.state[m] === "failed") return '<p class="error">' + esc(s2.errors[m]) + "</p>";
          const parsed = s2.parsed[m];
          const ranking = parsed ? '<div class="parsed"><h4>Extracted ranking</h4><ol>' +
            parsed.map((label) => "<li>" + esc(view.labelToModel[label] || label) + "</li>").join("") + "</ol></div>" : "";
          return '<div class="md">' + deanonymize(md.render(s2.text[m] || ""), view.labelToModel) + "</div>" + ranking;
        }) + leaderboard(view) + "</section>");
    }
    const s3 = view.stage3;
    if (s3.model) {
      parts.push('<section class="stage final" data-stage="3"><h3>Stage 3 · final answer</h3>' +
        '<p class="badge">Synthesised by ' + esc(s3.model) + "</p>" +
        (s3.note ? '<p class="note">The chairman failed (' + esc(s3.note) + "); this is the top-ranked member's answer.</p>" : "") +
        '<div class="md">' + (md.render(s3.text) || '<p class="muted">Writing…</p>') + "</div></section>");
    }
    if (STAGE_NOTES[view.status]) parts.push('<p class="progress">' + STAGE_NOTES[view.status] + "</p>");
    if (view.status === "error") parts.push('<p class="error">' + esc(view.error || "The council failed.") + "</p>");
    return '<article class="message assistant" data-job="' + esc(view.jobId || "") + '" data-status="' + esc(view.status) + '">' + parts.join("") + "</article>";
  }

  function leaderboard(view) {
    if (!view.aggregate.length) return "";
    const worst = Math.max(...view.aggregate.map((s) => s.average_rank), 1);
    const rows = view.aggregate.map((s, i) =>
      '<tr><td>' + (i + 1) + "</td><td>" + esc(s.model) + (i === 0 ? ' <span class="winner">Winner</span>' : "") +
      '</td><td class="bar"><span style="width:' + Math.round(100 * (worst + 1 - s.average_rank) / worst) + '%"></span></td>' +
      "<td>" + s.average_rank.toFixed(2) + "</td><td>" + s.rankings_count + "</td><td>" + s.first_places + "</td></tr>").join("");
    return '<div class="leaderboard"><h4>Aggregate ranking</h4><table><thead><tr><th>#</th><th>model</th><th></th>' +
      "<th>avg. position</th><th>votes</th><th>first places</th></tr></thead><tbody>" + rows + "</tbody></table></div>";
  }

  function draw() {
    drawPending = false;
    $("empty").hidden = messages.length > 0;
    const html = messages.map((m) => m.role === "user"
      ? '<article class="message user"><div class="md">' + md.render(m.content) + "</div></article>"
      : drawAssistant(m)).join("");
    const thread = $("thread");
    const atBottom = thread.scrollHeight - thread.scrollTop - thread.clientHeight < 80;
    thread.querySelectorAll(".message").forEach((n) => n.remove());
    thread.insertAdjacentHTML("beforeend", html);
    if (atBottom) thread.scrollTop = thread.scrollHeight;
    const busy = messages.some((m) => m.role === "assistant" && STAGE_NOTES[m.status]);
    $("send").disabled = busy;
    $("status").textContent = busy ? "The council is deliberating…" : "";
  }

  function redraw() {
    if (!drawPending) { drawPending = true; requestAnimationFrame(draw); }
  }

  $("thread").addEventListener("click", (e) => {
    const tab = e.target.closest(".tab");
    if (!tab) return;
    const article = tab.closest(".message");
    const view = messages.find((m) => m.role === "assistant" && m.jobId === article.dataset.job);
    if (view) { view["stage" + tab.dataset.stage].tab = tab.dataset.model; draw(); }
  });

  // --- following a job -----------------------------------------------------------------------
  async function follow(view, start) {
    if (following) following.abort();
    const controller = (following = new AbortController());
    for (let attempt = 0; attempt < 30 && !controller.signal.aborted; attempt++) {
      try {
        const response = attempt === 0 && start ? await start(controller.signal)
          : await api("conversations/" + conversationId + "/job/stream?after=" + view.lastSeq +
              (view.jobId ? "&job_id=" + view.jobId : ""), { signal: controller.signal });
        await readEvents(response, (e) => {
          if (!view.jobId) view.jobId = e.job_id;
          if (e.seq > view.lastSeq) { apply(view, e); redraw(); }
        });
        if (!STAGE_NOTES[view.status]) break;
      } catch (error) {
        if (controller.signal.aborted) return;
        if (error.status === 409 || error.status === 400) { view.status = "error"; view.error = error.message; redraw(); return; }
      }
      // The stream ended early (network, proxy restart): come back for what follows.
      await new Promise((resolve) => setTimeout(resolve, Math.min(5000, 500 * (attempt + 1))));
    }
    if (following === controller) following = null;
    loadConversations();
  }

  // --- conversations -------------------------------------------------------------------------
  async function loadConversations() {
    const list = await (await api("conversations")).json();
    $("conversations").innerHTML = list.map((c) =>
      '<li class="' + (c.id === conversationId ? "active" : "") + '"><a href="#' + esc(c.id) + '">' + esc(c.title) +
      '<small>' + c.message_count / 2 + " question" + (c.message_count === 2 ? "" : "s") + "</small></a>" +
      '<button type="button" class="delete" data-id="' + esc(c.id) + '" title="Delete">×</button></li>').join("");
  }

  async function open(id) {
    if (following) { following.abort(); following = null; }
    conversationId = id;
    messages = [];
    if (!id) { draw(); loadConversations(); return; }
    let conversation;
    try {
      conversation = await (await api("conversations/" + id)).json();
    } catch (error) {
      location.hash = "";
      return;
    }
    messages = conversation.messages.map((m) => m.role === "user" ? m : fromStored(m));
    draw();
    loadConversations();
    const status = await (await api("conversations/" + id + "/job/status")).json();
    if (status.active) {
      // Rebuild the running job's message from its first event, then follow it live.
      const index = messages.findIndex((m) => m.role === "assistant" && m.jobId === status.job_id);
      const view = newAssistant(status.job_id);
      if (index >= 0) messages[index] = view; else messages.push(view);
      draw();
      follow(view, null);
    }
  }

  $("conversations").addEventListener("click", async (e) => {
    const button = e.target.closest(".delete");
    if (!button) return;
    e.preventDefault();
    try {
      await api("conversations/" + button.dataset.id, { method: "DELETE" });
    } catch (error) {
      $("status").textContent = error.message;
      return;
    }
    if (button.dataset.id === conversationId) location.hash = ""; else loadConversations();
  });

  async function newConversation() {
    const conversation = await (await api("conversations", { method: "POST" })).json();
    // Set without a hashchange: that would reopen the conversation under our feet.
    history.pushState(null, "", "#" + conversation.id);
    if (following) { following.abort(); following = null; }
    conversationId = conversation.id;
    messages = [];
    draw();
    loadConversations();
    return conversation.id;
  }

  $("new").addEventListener("click", newConversation);
  window.addEventListener("hashchange", () => open(location.hash.slice(1) || null));

  async function send() {
    const text = $("question").value.trim();
    if (!text) return;
    if (!conversationId) await newConversation();
    $("question").value = "";
    const view = newAssistant(null);
    messages.push({ role: "user", content: text }, view);
    draw();
    follow(view, (signal) => api("conversations/" + conversationId + "/message/stream", {
      method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ content: text }), signal,
    }));
  }

  $("ask").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("question").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });

  api("config").then((r) => r.json()).then((c) => {
    $("members").innerHTML = c.members.length
      ? "Members: " + c.members.map(esc).join(", ") + "<br>Chairman: " + esc(c.chairman)
      : "No council configured: start the proxy with --council-models.";
  }).catch(() => {});
  open(location.hash.slice(1) || null);
})();
