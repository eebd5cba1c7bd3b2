// The layer viewer: one request with attention_maps, drawn as tables and SVG. No framework.
// Deep link: /ui?prompt=...&layer=...&head=... renders at once. The API key, when the server
// wants one, lives in this tab's sessionStorage and travels only as an Authorization header.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const state = { config: null, result: null, layer: 0, head: 0 };

function visible(token) {  // GPT-2's leading space, shown
  return token.replace(/ /g, "␣").replace(/\n/g, "\\n").replace(/\t/g, "\\t");
}

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

function shade(value, max) {  // 0..max -> white..blue
  const t = max > 0 ? Math.max(0, Math.min(1, value / max)) : 0;
  return `rgb(${Math.round(255 - 205 * t)},${Math.round(255 - 160 * t)},255)`;
}

function show(id, text) {
  $(id).textContent = text;
  $(id).hidden = !text;
}

function headers() {
  const h = { "content-type": "application/json" };
  const key = sessionStorage.getItem("gpt2serve-key");
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

async function start() {
  state.config = await (await fetch("/ui/config.json")).json();
  if (state.config.trace_layers === "never") {
    show("notice", "Layer data is off on this server (--trace-layers never): only the answer can be shown.");
  }
  if (state.config.api_key_required && !sessionStorage.getItem("gpt2serve-key")) $("key-form").hidden = false;
  else await loadModel();
  const params = new URLSearchParams(location.search);
  state.layer = Number(params.get("layer") || 0);
  state.head = Number(params.get("head") || 0);
  if (params.get("prompt")) {
    $("prompt").value = params.get("prompt");
    if (params.get("top_k")) $("top-k").value = params.get("top_k");
    await run();
  }
}

async function loadModel() {
  const response = await fetch("/v1/model", { headers: headers() });
  if (!response.ok) return;
  const info = await response.json();
  $("model").textContent = `${info.model} (${info.weights} weights, ${info.dtype} on ${info.device})`;
  renderParams(info);
}

function renderParams(info) {
  const p = info.parameters, a = info.architecture, n = a.n_layer;
  const pct = (v) => `${(100 * v / p.total).toFixed(2)}%`;
  const block = (p.attention_qkv + p.attention_output + p.mlp) / n + 4 * a.d_model;
  const rows = [["token embedding (wte)", p.token_embedding], ["position embedding (wpe)", p.position_embedding],
    [`attention QKV (${n} blocks)`, p.attention_qkv], [`attention output (${n} blocks)`, p.attention_output],
    [`MLP (${n} blocks)`, p.mlp], ["layer norms", p.layer_norm], [p.lm_head ? "lm_head" : "lm_head (tied to wte)", p.lm_head],
    ["total", p.total], ["one block", block]];
  $("params").replaceChildren(el("h2", {}, "Where the parameters live ", el("small", {}, `${n} layers, d_model ${a.d_model}, ` +
    `${a.n_head} heads, d_mlp ${a.d_mlp}, vocabulary ${a.vocab_size}`)),
    el("table", { id: "param-table" }, ...rows.map(([name, v]) => el("tr", {}, el("th", {}, name), el("td", {}, v.toLocaleString("en")),
      el("td", {}, pct(v))))));
  $("results").hidden = false;
}

async function run() {
  show("error", "");
  if (state.config.api_key_required && !sessionStorage.getItem("gpt2serve-key")) {
    $("key-form").hidden = false;
    show("error", "Enter the API key first.");
    return;
  }
  const layersOn = state.config.trace_layers !== "never";
  const body = { prompt: $("prompt").value, top_k: Number($("top-k").value) || 5,
                 attention_maps: layersOn, trace_layers: layersOn && Boolean(state.config.trace_ui_url) };
  const response = await fetch("/v1/next-token", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  const data = await response.json();
  if (!response.ok) {
    if (response.status === 401) { sessionStorage.removeItem("gpt2serve-key"); $("key-form").hidden = false; }
    show("error", `${data.error.code}: ${data.error.message}`);
    $("results").hidden = true;
    return;
  }
  state.result = data;
  state.layer = Math.min(state.layer, Math.max(data.layers.length - 1, 0));
  render();
}

function render() {
  const r = state.result;
  $("results").hidden = false;
  renderAnswer(r);
  for (const id of ["heads", "heatmaps", "lens", "layers"]) $(id).replaceChildren();
  $("layer-index").textContent = "";
  if (!r.layers.length) return;
  renderHeads(r);
  renderHeatmaps(r);
  renderLens(r);
  renderLayers(r);
}

function renderAnswer(r) {
  const rows = r.top.map((t, i) => el("tr", {}, el("td", {}, String(i + 1)), el("td", { class: "tok" }, visible(t.token)),
    el("td", {}, Math.exp(t.logprob).toFixed(4)), el("td", {}, t.logprob.toFixed(3)), el("td", {}, String(t.token_id))));
  const table = el("table", { id: "top" }, el("tr", {}, ...["rank", "token", "prob", "logprob", "id"].map((h) => el("th", {}, h))), ...rows);
  const answer = el("p", {}, "Next token: ", el("strong", { class: "tok", id: "next-token" }, visible(r.token)),
    ` (p = ${Math.exp(r.logprob).toFixed(4)}), ${r.prompt_token_ids.length} prompt tokens, forward ${r.timings.forward_ms.toFixed(1)} ms`);
  const parts = [answer, table];
  if (r.trace_id && state.config.trace_ui_url) {
    parts.push(el("p", {}, el("a", { id: "trace-link", href: state.config.trace_ui_url.replace("{trace_id}", r.trace_id), target: "_blank" },
      `This request's trace (${r.trace_id})`)));
  }
  $("answer").replaceChildren(...parts);
}

function renderHeads(r) {
  const key = $("summary").value;
  const values = r.layers.flatMap((l) => l.heads.map((h) => h[key]));
  const min = Math.min(...values), span = Math.max(Math.max(...values) - min, 1e-9);  // colour the spread
  const head = el("tr", {}, el("th", {}, "layer \\ head"), ...r.layers[0].heads.map((_, h) => el("th", {}, String(h))));
  const rows = r.layers.map((layer, li) => el("tr", { class: "head-row" }, el("th", {}, String(li)),
    ...layer.heads.map((h, hi) => {
      const cell = el("td", { title: `layer ${li} head ${hi}: ${key} ${h[key].toFixed(3)}`, style: `background:${shade(h[key] - min, span)}`,
                              "data-layer": li, "data-head": hi });
      if (li === state.layer && hi === state.head) cell.classList.add("chosen");
      cell.addEventListener("click", () => { state.layer = li; state.head = hi; render(); });
      return cell;
    })));
  $("heads").replaceChildren(head, ...rows);
}

function heatmap(report, head, tokens) {
  const map = attentionMap(report, head);
  const n = tokens.length, cell = Math.max(8, Math.min(22, Math.floor(280 / n))), margin = 70;
  const size = margin + n * cell;
  const svg = el("svg:svg", { class: "heatmap", width: size, height: size, "data-layer": report.index, "data-head": head });
  tokens.forEach((token, i) => {
    svg.append(el("svg:text", { class: "axis-token query", x: margin - 4, y: margin + i * cell + cell * 0.7, "text-anchor": "end" }, visible(token)));
    svg.append(el("svg:text", { class: "axis-token key", transform: `translate(${margin + i * cell + cell * 0.7},${margin - 4}) rotate(-60)` }, visible(token)));
  });
  map.forEach((row, q) => row.forEach((w, k) => {
    if (k > q) return;  // causal: nothing to draw above the diagonal
    const rect = el("svg:rect", { x: margin + k * cell, y: margin + q * cell, width: cell, height: cell, fill: shade(w, 1) });
    rect.append(el("svg:title", {}, `${visible(tokens[q])} → ${visible(tokens[k])}: ${w.toFixed(3)}`));
    svg.append(rect);
  }));
  return svg;
}

function attentionMap(report, head) {
  const n = report.attn_shape[2], start = head * n * n, rows = [];
  for (let q = 0; q < n; q++) rows.push(report.attention.slice(start + q * n, start + (q + 1) * n));
  return rows;
}

function renderHeatmaps(r) {
  const report = r.layers[state.layer];
  $("layer-index").textContent = String(state.layer);
  if (!report.attention.length) return;
  const tokens = r.prompt_tokens;
  $("heatmaps").replaceChildren(...report.heads.map((h, head) => {
    const figure = el("figure", { class: head === state.head ? "head chosen" : "head" }, heatmap(report, head, tokens),
      el("figcaption", {}, `head ${head}: entropy ${h.entropy.toFixed(2)}, max ${h.max_weight.toFixed(2)} on ` +
        `${visible(h.top_token)} (position ${h.top_position}), first-token ${h.first_token_weight.toFixed(2)}, ` +
        `previous-token ${h.previous_token_score.toFixed(2)}`));
    return figure;
  }));
}

function renderLens(r) {
  const tokens = r.prompt_tokens;
  const head = el("tr", {}, el("th", {}, "after layer"), ...tokens.map((t) => el("th", { class: "tok" }, visible(t))));
  const rows = r.layers.map((layer, li) => el("tr", { class: "lens-row" }, el("th", {}, String(li)),
    ...layer.logit_lens_positions.map((t) => el("td", { style: `background:${shade(t.prob, 1)}`, title: `p = ${t.prob.toFixed(4)}` },
      el("div", { class: "tok" }, visible(t.token)), el("small", {}, t.prob.toFixed(2))))));
  $("lens").replaceChildren(head, ...rows);
}

function renderLayers(r) {
  const head = el("tr", {}, ...["layer", "hidden (batch)", "attention (batch)", "hidden (prompt)", "attention (prompt)", "MLP (prompt)",
    "residual norm", "ms"].map((h) => el("th", {}, h)));
  const shape = (s) => `[${s.join(", ")}]`;
  const rows = r.layers.map((l) => el("tr", { class: "layer-row" }, el("td", {}, String(l.index)), el("td", {}, shape(l.batch_hidden_shape)),
    el("td", {}, shape(l.batch_attn_shape)), el("td", {}, shape(l.hidden_shape)), el("td", {}, shape(l.attn_shape)),
    el("td", {}, shape(l.mlp_shape)), el("td", {}, l.residual_norm.toFixed(1)), el("td", {}, l.duration_ms.toFixed(2))));
  $("layers").replaceChildren(head, ...rows);
}

$("ask").addEventListener("submit", (event) => { event.preventDefault(); run(); });
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("gpt2serve-key", $("key").value);
  $("key").value = "";
  $("key-form").hidden = true;
  show("error", "");
  loadModel();
});
$("summary").addEventListener("change", () => state.result && render());
start().catch((error) => show("error", `The page could not start: ${error}`));
