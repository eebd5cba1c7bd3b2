// "Generate, step by step": one POST /v1/generate with trace_steps, then its steps one at a
// time: the prefill (the prompt's forward), then each decode step, where the previous token's
// row alone goes through the model and attends over the KV cache, one column longer each step.
"use strict";

const gen = { result: null, step: 0, head: "mean" };

function startGenerate(params) {
  if (params.get("max_tokens")) $("gen-max").value = params.get("max_tokens");
  if (params.get("temperature")) $("gen-temperature").value = params.get("temperature");
  if (params.get("repetition_penalty")) $("gen-repetition").value = params.get("repetition_penalty");
  if (params.get("constraint")) $("gen-constraint").value = params.get("constraint");
  if (params.get("constraint_text")) $("gen-constraint-text").value = params.get("constraint_text");
  $("gen-chat").checked = params.get("chat") === "1";
  gen.step = Number(params.get("step") || 0);
  if (params.get("prompt")) {
    $("gen-prompt").value = params.get("prompt");
    return generate();
  }
}

async function generate() {
  show("error", "");
  if (keyMissing()) return;
  const text = $("gen-prompt").value;
  // As a chat message, the server's chat template makes the prompt: the prefill step shows its tokens.
  const prompt = $("gen-chat").checked ? { messages: [{ role: "user", content: text }] } : { prompt: text };
  const body = { ...prompt, max_tokens: Number($("gen-max").value) || 8,
                 temperature: Number($("gen-temperature").value), trace_steps: true, logprobs: 5 };
  const repetition = Number($("gen-repetition").value);
  if (repetition && repetition !== 1) body.repetition_penalty = repetition;
  const constraint = constraintField($("gen-constraint").value, $("gen-constraint-text").value);
  if (constraint === undefined) return;
  if (constraint) body.structured_outputs = constraint;
  const data = await post("/v1/generate", body);
  if (!data) { $("generate-view").hidden = true; return; }
  gen.result = data;
  gen.step = Math.min(gen.step, data.steps.length - 1);
  $("step-slider").max = String(data.steps.length - 1);
  const first = data.steps[0];
  $("step-head").replaceChildren(el("option", { value: "mean" }, "the mean of the heads"),
    ...Array.from({ length: first.n_head }, (_, h) => el("option", { value: String(h) }, `head ${h}`)));
  $("generate-view").hidden = false;
  renderStep();
  clickRequested($("step-walkthrough"));
}

function constraintField(kind, text) {  // vLLM's structured_outputs; undefined: not sent (the error is shown)
  if (!kind) return null;
  if (kind === "choice") return { choice: text.split("|") };
  if (kind === "regex") return { regex: text };
  try {
    return { json: JSON.parse(text) };
  } catch (error) {
    show("error", `the JSON schema is not JSON: ${error.message}`);
    return undefined;
  }
}

function context(upTo) {  // the tokens step `upTo` attends over: every step's new rows so far
  return gen.result.steps.slice(0, upTo + 1).flatMap((s) => s.new_tokens);
}

function renderStep() {
  const steps = gen.result.steps, step = steps[gen.step];
  $("step-slider").value = String(gen.step);
  const kind = step.index === 0 ? "prefill: the prompt's forward, every row at once" : "decode: one new row, over the cache";
  $("step-title").textContent = `step ${step.index} of ${steps.length - 1}: ${kind}; new rows ${shapeText(step.new_row_shape)}, ` +
    `KV cache ${shapeText(step.kv_cache_shape)} per layer (K and V each); chose ${visible(step.token)}`;
  renderSequence(steps);
  renderCache(step, steps[steps.length - 1].context_tokens);
  renderStepAttention(step);
  $("step-top").replaceChildren(tokenTable("step-top-table", step.top, step.token_id));
  renderControlled(step);
  $("step-lens").replaceChildren(el("tr", {}, el("th", {}, "after block"), el("th", {}, "token"), el("th", {}, "p")),
    ...step.logit_lens.map((t, layer) => el("tr", { class: "step-lens-row" }, el("th", {}, String(layer)),
      el("td", { class: "tok", style: `background:${shade(t.prob, 1)}` }, visible(t.token)), el("td", {}, t.prob.toFixed(3)))));
  drawWalkthrough($("step-walkthrough"), step.walkthrough, { repeat: step.n_layer, onSelect: (s) => {
    $("step-detail").replaceChildren(...stepHeader(s), el("p", {}, stepNote(s, step)));
    $("step-detail").hidden = false;
  } });
}

function renderControlled(step) {  // what the sampling controls made of this step (none: hidden)
  $("step-controlled-section").hidden = step.allowed_tokens === 0;
  if (step.allowed_tokens === 0) return;
  const vocab = step.walkthrough.find((s) => s.name === "logits").shape.at(-1);
  $("step-allowed").textContent = step.allowed_tokens === vocab ? `every one of the ${vocab} tokens left possible`
    : `${step.allowed_tokens} of ${vocab} tokens allowed` + (step.allowed_tokens === 1 ? ": the constraint forced this one" : "");
  $("step-controlled").replaceChildren(tokenTable("step-controlled-table", step.controlled_top, step.token_id));
}

function stepNote(s, step) {
  if (s.name.startsWith("K cache") || s.name.startsWith("V cache")) {
    return `${step.context_tokens} positions of ${step.kv_cache_shape[2]} numbers per head; the last ${step.new_row_shape[0]} were added by this step.`;
  }
  if (s.name.startsWith("attention row") || s.name.startsWith("softmax")) return "Its numbers are drawn above: where the new row looks.";
  if (s.name === "logits" || s.name === "chosen token") return `Chosen: ${visible(step.token)}; the top tokens are listed above.`;
  return s.note || "The shape of this step's matrix.";
}

function renderSequence(steps) {
  const final = steps[steps.length - 1];
  const tokens = [...context(steps.length - 1), final.token];  // everything, the last chosen token included
  const promptLength = steps[0].new_tokens.length;
  $("gen-tokens").replaceChildren(...tokens.map((token, position) => {
    const chosenBy = position - promptLength;  // the step that chose this token (prompt tokens: none)
    const attrs = { class: chosenBy < 0 ? "seq-token prompt-token" : "seq-token gen-token", "data-position": position };
    if (chosenBy >= 0) attrs["data-step"] = chosenBy;
    if (chosenBy === gen.step) attrs.class += " current";
    const span = el("span", attrs, visible(token));
    if (chosenBy >= 0) span.addEventListener("click", () => { gen.step = chosenBy; renderStep(); });
    return span;
  }));
}

function renderCache(step, longest) {
  const heads = step.n_head, cell = Math.max(6, Math.min(16, Math.floor(560 / longest))), left = 54;
  const svg = el("svg:svg", { id: "kv-cache-svg", width: left + longest * cell + 4, height: heads * (cell + 2) + 16,
                              "data-heads": heads, "data-columns": step.context_tokens, "data-new": step.new_row_shape[0] });
  const firstNew = step.context_tokens - step.new_row_shape[0];
  for (let h = 0; h < heads; h++) {
    svg.append(el("svg:text", { x: 0, y: 14 + h * (cell + 2) + cell * 0.8 }, `head ${h}`));
    for (let p = 0; p < longest; p++) {
      const cls = p >= step.context_tokens ? "cache-empty" : p >= firstNew ? "cache-new" : "cache-kept";
      svg.append(el("svg:rect", { x: left + p * cell, y: 14 + h * (cell + 2), width: cell - 1, height: cell, class: cls }));
    }
  }
  $("kv-cache").replaceChildren(svg, el("p", { class: "note" }, `${step.context_tokens} of the generation's ${longest} positions held ` +
    `after this step, in each of ${step.n_layer} layers; a cell is one position's ${step.kv_cache_shape[2]} key and ` +
    `${step.kv_cache_shape[2]} value numbers for one head`));
}

function renderStepAttention(step) {
  const tokens = context(step.index), n = step.context_tokens;
  const head = el("tr", {}, el("th", {}, "block"), ...tokens.map((t) => el("th", { class: "tok" }, visible(t))));
  const rows = [];
  for (let layer = 0; layer < step.n_layer; layer++) {
    const heads = Array.from({ length: step.n_head }, (_, h) => step.attention.slice((layer * step.n_head + h) * n, (layer * step.n_head + h + 1) * n));
    const row = gen.head === "mean" ? heads[0].map((_, p) => heads.reduce((sum, r) => sum + r[p], 0) / step.n_head) : heads[Number(gen.head)];
    rows.push(el("tr", { class: "attn-row" }, el("th", {}, String(layer)),
      ...row.map((w, p) => el("td", { style: `background:${shade(w, 1)}`, title: `${visible(tokens[p])}: ${w.toFixed(3)}` }, w.toFixed(2)))));
  }
  $("step-attention").replaceChildren(head, ...rows);
}

$("gen-form").addEventListener("submit", (event) => { event.preventDefault(); gen.step = 0; generate(); });
$("step-slider").addEventListener("input", () => { gen.step = Number($("step-slider").value); renderStep(); });
$("step-prev").addEventListener("click", () => { if (gen.result && gen.step > 0) { gen.step--; renderStep(); } });
$("step-next").addEventListener("click", () => {
  if (gen.result && gen.step < gen.result.steps.length - 1) { gen.step++; renderStep(); }
});
$("step-head").addEventListener("change", () => { gen.head = $("step-head").value; if (gen.result) renderStep(); });
