// "Model shapes": a preset's walk-through without weights (Llama, Qwen, DeepSeek, GPT-3...), from
// its config: what its matrices look like for the same few tokens. /ui/presets/NAME.json.
"use strict";

async function startShapes(params) {
  const list = await (await fetch("/ui/presets.json")).json();
  $("preset").replaceChildren(...list.presets.map((p) => el("option", { value: p.name }, p.name)));
  $("preset").value = params.get("preset") || "llama-3-8b";
  if (params.get("tokens")) $("shape-tokens").value = params.get("tokens");
  if (params.get("batch")) $("shape-batch").value = params.get("batch");
  await drawPreset();
}

async function drawPreset() {
  show("error", "");
  const query = `tokens=${Number($("shape-tokens").value) || 5}&batch=${Number($("shape-batch").value) || 1}`;
  const response = await fetch(`/ui/presets/${encodeURIComponent($("preset").value)}.json?${query}`);
  const data = await response.json();
  if (!response.ok) { show("error", `${data.error.code}: ${data.error.message}`); return; }
  $("shapes-title").replaceChildren(`${data.name} `, el("small", {}, data.description));
  $("shapes-published").textContent = data.published ? `Published: ${data.published}` : "";
  drawWalkthrough($("shapes-walkthrough"), data.walkthrough, { repeat: data.parameters.n_layer, onSelect: (step) => {
    $("shapes-detail").replaceChildren(...stepHeader(step), el("p", {}, "Drawn from the config alone: no weights, no numbers."));
    $("shapes-detail").hidden = false;
  } });
  const p = data.parameters, pct = (v) => `${(100 * v / p.total).toFixed(2)}%`;
  const rows = p.lines.map((line) => el("tr", { class: "param-line", "data-key": line.key }, el("th", {}, line.component),
    el("td", {}, line.parameters.toLocaleString("en")), el("td", {}, pct(line.parameters)), el("td", { class: "note" }, line.note)));
  rows.push(el("tr", { id: "shapes-total" }, el("th", {}, "total"), el("td", {}, p.total.toLocaleString("en")), el("td", {}, "100%"), el("td")));
  if (p.active !== null) {
    rows.push(el("tr", { id: "shapes-active" }, el("th", {}, "active per token"), el("td", {}, p.active.toLocaleString("en")),
      el("td", {}, pct(p.active)), el("td", { class: "note" }, "mixture of experts: what one token goes through")));
  }
  $("shapes-params").replaceChildren(...rows);
  $("shapes-view").hidden = false;
  clickRequested($("shapes-walkthrough"));
}

$("shapes-form").addEventListener("submit", (event) => { event.preventDefault(); drawPreset(); });
