// The viewer's entry and its "Next token" view: one request with attention_maps, drawn as the
// shape walk-through, tables and SVG. Deep links render at once:
//   /ui?prompt=...&layer=...&head=...&click=STEP        (next token; &adapter=NAME: beside the base, adapters.js)
//   /ui?view=generate&prompt=...&max_tokens=8&step=3   (generate.js; &chat=1: as a chat message)
//       &repetition_penalty=1.3&constraint=choice|regex|json&constraint_text=yes|no: sampling controls
//   /ui?view=shapes&preset=llama-3-8b&tokens=5         (shapes.js)
//   /ui?view=score&text=...&top_k=5                     (score.js)
"use strict";

const state = { config: null, model: null, result: null, layer: 0, head: 0, view: "next" };

async function start() {
  state.config = await (await fetch("/ui/config.json")).json();
  const params = new URLSearchParams(location.search);
  state.view = ["generate", "shapes", "score"].includes(params.get("view")) ? params.get("view") : "next";
  showView(state.view);
  if (state.config.trace_layers === "never" && state.view !== "shapes") {
    show("notice", "Layer data is off on this server (--trace-layers never): only the answer can be shown.");
  }
  if (state.view === "shapes") return startShapes(params);  // no model data: no key needed
  if (state.config.api_key_required && !sessionStorage.getItem("gpt2serve-key")) $("key-form").hidden = false;
  else await loadModel();
  if (state.view === "generate") return startGenerate(params);
  if (state.view === "score") return startScore(params);
  state.layer = Number(params.get("layer") || 0);
  state.head = Number(params.get("head") || 0);
  if (params.get("prompt")) {
    $("prompt").value = params.get("prompt");
    if (params.get("top_k")) $("top-k").value = params.get("top_k");
    await run();
  }
}

function showView(view) {
  for (const node of document.querySelectorAll("[data-view]")) {
    if (node.tagName === "A") node.classList.toggle("current", node.dataset.view === view);
    else if (node.tagName !== "MAIN") node.hidden = node.dataset.view !== view;
  }
}

function keyMissing() {
  if (state.config.api_key_required && !sessionStorage.getItem("gpt2serve-key")) {
    $("key-form").hidden = false;
    show("error", "Enter the API key first.");
    return true;
  }
  return false;
}

async function loadModel() {
  const response = await fetch("/v1/model", { headers: headers() });
  if (!response.ok) return;
  const info = state.model = await response.json();
  fillAdapters(info.adapters || [], new URLSearchParams(location.search).get("adapter"));
  $("model").textContent = `${info.model} (${info.weights} weights, ${info.dtype} on ${info.device})`;
  if (state.view === "next") renderParams(info);
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
  if (keyMissing()) return;
  const layersOn = state.config.trace_layers !== "never";
  const body = { prompt: $("prompt").value, top_k: Number($("top-k").value) || 5,
                 attention_maps: layersOn, trace_layers: layersOn && Boolean(state.config.trace_ui_url) };
  if ($("adapter").value) Object.assign(body, { adapter: $("adapter").value, compare_base: layersOn });
  const data = await post("/v1/next-token", body);
  if (!data) { $("results").hidden = true; return; }
  state.result = data;
  state.layer = Math.min(state.layer, Math.max(data.layers.length - 1, 0));
  render();
  clickRequested($("walkthrough"));
}

function render() {
  const r = state.result;
  $("results").hidden = false;
  renderAnswer(r);
  renderBeside(r);
  for (const id of ["heads", "heatmaps", "lens", "layers", "walkthrough"]) $(id).replaceChildren();
  $("layer-index").textContent = "";
  if (!r.layers.length) return;
  renderWalk(r);
  renderHeads(r);
  renderHeatmaps(r);
  renderLens(r);
  renderLayers(r);
}

function renderAnswer(r) {
  const answer = el("p", {}, "Next token: ", el("strong", { class: "tok", id: "next-token" }, visible(r.token)),
    ` (p = ${Math.exp(r.logprob).toFixed(4)}), ${r.prompt_token_ids.length} prompt tokens, forward ${r.timings.forward_ms.toFixed(1)} ms`);
  const parts = [answer, tokenTable("top", r.top, r.token_id)];
  if (r.trace_id && state.config.trace_ui_url) {
    parts.push(el("p", {}, el("a", { id: "trace-link", href: state.config.trace_ui_url.replace("{trace_id}", r.trace_id), target: "_blank" },
      `This request's trace (${r.trace_id})`)));
  }
  $("answer").replaceChildren(...parts);
}

// The walk-through of this forward, and what the seeds' explainers round or simplify.
function renderWalk(r) {
  const steps = r.walkthrough, byName = Object.fromEntries(steps.map((s) => [s.name, s.shape]));
  const vocab = byName.logits[byName.logits.length - 1], [batch, length] = byName["token ids"];
  $("seeds-note").textContent = `Where this differs from the seeds' pictures: GPT-2's vocabulary is ${vocab.toLocaleString("en")} tokens, ` +
    `not 50,000, so the embedding is [${vocab}, ${byName["token embedding"][1]}] and the logits end in ${vocab}; and nothing is padded ` +
    `to 1024: this forward ran at ${length} positions (the prompt's own length; a batch pads each prompt only to its longest). ` +
    `Only the last row goes through the final norm and the LM head, so the logits are [${batch}, ${vocab}], not ` +
    `[${batch}, ${length}, ${vocab}] as in the seeds' batch example: a server never needs the other positions' predictions. ` +
    (batch > 1 ? `It shared its forward with ${batch - 1} other row(s)${r.base_top && r.base_top.length ? ", one of them this " +
      "prompt under the base model, set beside it above" : ""}: the first dimension is the batch.` : "The first dimension is the batch: 1 here.");
  $("walk-layer").replaceChildren(...r.layers.map((l) => el("option", { value: l.index }, String(l.index))));
  $("walk-layer").value = String(state.layer);
  $("walk-layer-label").hidden = false;
  drawWalkthrough($("walkthrough"), steps, { repeat: r.layers.length, onSelect: (step, index) => selectStep(step, index) });
}

function selectStep(step, index) {
  state.selected = index;
  for (const f of $("walkthrough").querySelectorAll("figure.shape-block")) f.classList.toggle("selected", Number(f.dataset.index) === index);
  $("shape-detail").replaceChildren(...stepHeader(step), stepNumbers(step));
  $("shape-detail").hidden = false;
}

// What the trace has for a step: its numbers for the chosen block, or why there are none.
function stepNumbers(step) {
  const r = state.result, layer = r.layers[state.layer], name = step.name;
  if (step.kind === "weight") {
    return el("p", {}, `A weight: ${elements(step.shape).toLocaleString("en")} parameters (${step.shape.join(" × ")}), the same for ` +
      "every prompt; a bias, where there is one, is not drawn.");
  }
  if (name === "token ids") {
    return el("table", { class: "numbers" }, el("tr", {}, el("th", {}, "token"), ...r.prompt_tokens.map((t) => el("td", { class: "tok" }, visible(t)))),
      el("tr", {}, el("th", {}, "id"), ...r.prompt_token_ids.map((i) => el("td", {}, String(i)))));
  }
  if (name.startsWith("QKᵀ") || name.startsWith("softmax")) {
    return el("div", { class: "numbers heatmaps" }, ...layer.heads.map((h, head) => el("figure", { class: "head" },
      heatmap(layer, head, r.prompt_tokens), el("figcaption", {}, `block ${layer.index}, head ${head}`))));
  }
  if (name.endsWith("per head") || name === "weights × V") {
    return numbersTable(["head", "entropy", "max weight", "looks at", "previous-token"], layer.heads.map((h, i) =>
      [i, h.entropy.toFixed(3), h.max_weight.toFixed(3), visible(h.top_token), h.previous_token_score.toFixed(3)]));
  }
  const perLayer = (label, key) => numbersTable(["block", label], r.layers.map((l) => [l.index, l[key].toFixed(2)]));
  if (name === "attention output" || name === "residual + attention") return perLayer("attention output norm (last position)", "attn_output_norm");
  if (name.startsWith("MLP")) return perLayer("MLP output norm (last position)", "mlp_output_norm");
  if (name === "residual + MLP" || name === "last row" || name.startsWith("normalised")) {
    return numbersTable(["block", "residual norm", "logit lens (top token, p)"], r.layers.map((l) =>
      [l.index, l.residual_norm.toFixed(2), `${visible(l.logit_lens[0].token)} ${l.logit_lens[0].prob.toFixed(3)}`]));
  }
  if (name === "logits" || name === "chosen token") return tokenTable("detail-top", r.top, r.token_id);
  return el("p", {}, "The trace keeps no numbers for this matrix; its shape is the real forward's.");
}

function numbersTable(head, rows) {
  return el("table", { class: "numbers" }, el("tr", {}, ...head.map((h) => el("th", {}, h))),
    ...rows.map((row) => el("tr", {}, ...row.map((v) => el("td", {}, String(v))))));
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
  const rows = r.layers.map((l) => el("tr", { class: "layer-row" }, el("td", {}, String(l.index)), el("td", {}, shapeText(l.batch_hidden_shape)),
    el("td", {}, shapeText(l.batch_attn_shape)), el("td", {}, shapeText(l.hidden_shape)), el("td", {}, shapeText(l.attn_shape)),
    el("td", {}, shapeText(l.mlp_shape)), el("td", {}, l.residual_norm.toFixed(1)), el("td", {}, l.duration_ms.toFixed(2))));
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
$("walk-layer").addEventListener("change", () => {
  state.layer = Number($("walk-layer").value);
  render();
  if (state.selected !== undefined) selectStep(state.result.walkthrough[state.selected], state.selected);
});
start().catch((error) => show("error", `The page could not start: ${error}`));
