// The shape walk-through as a picture: every matrix of the forward, data in blue and weights in
// orange, each drawn to a log scale of its real shape (rows x columns; leading dimensions such as
// the batch and the heads as a stack of sheets) and labelled with that shape. The steps come from
// the server: from the real forward (next token, generate) or from a preset's config (shapes).
"use strict";

const STAGES = { input: "Input", block: "Each block", output: "Output" };
const MAX_SHEETS = 4;

function side(n) {  // px for a dimension of n, log scale: 1 -> 6 px, 768 -> 121, 50257 -> 193
  return Math.round(6 + 11 * Math.log2(Math.max(n, 1)));
}

function block(step) {
  const shape = step.shape.length ? step.shape : [1];
  const cols = shape[shape.length - 1], rows = shape.length > 1 ? shape[shape.length - 2] : 1;
  const stack = elements(shape.slice(0, -2)), sheets = Math.min(stack, MAX_SHEETS), gap = 5;
  const w = side(cols), h = side(rows), width = w + gap * (sheets - 1) + 2, height = h + gap * (sheets - 1) + 2;
  const svg = el("svg:svg", { width, height, class: "block-svg" });
  for (let i = sheets - 1; i >= 0; i--) {  // back to front
    svg.append(el("svg:rect", { x: 1 + gap * i, y: 1 + gap * (sheets - 1 - i), width: w, height: h, class: `sheet ${step.kind}` }));
  }
  return svg;
}

// Draws `steps` into `container`. options: { repeat (blocks), onSelect(step, index), selected }.
function drawWalkthrough(container, steps, options = {}) {
  const groups = [];
  let current = null;
  steps.forEach((step, index) => {
    if (!current || current.stage !== step.stage) {
      current = { stage: step.stage, items: [] };
      groups.push(current);
    }
    current.items.push([step, index]);
  });
  const legend = el("p", { class: "legend" }, el("span", { class: "swatch data" }), " data the forward computed ",
    el("span", { class: "swatch weight" }), " weights [in, out], as in x @ W; sizes on a log scale, stacked sheets for the leading dimensions (batch, heads)");
  container.replaceChildren(legend, ...groups.map((group) => {
    const title = group.stage === "block" && options.repeat ? `${STAGES.block} (× ${options.repeat}, the same shapes in every block)` : STAGES[group.stage] || group.stage;
    return el("section", { class: `stage stage-${group.stage}` }, el("h3", {}, title),
      el("div", { class: "blocks" }, ...group.items.map(([step, index]) => {
        const figure = el("figure", { class: `shape-block ${step.kind}${options.selected === index ? " selected" : ""}`, tabindex: "0",
          "data-name": step.name, "data-shape": step.shape.join(","), "data-kind": step.kind, "data-stage": step.stage, "data-index": index,
          title: step.note || step.name },
          block(step), el("figcaption", {}, el("b", {}, step.name), el("br"), el("span", { class: "shape" }, shapeText(step.shape))));
        if (options.onSelect) {
          figure.addEventListener("click", () => options.onSelect(step, index));
          figure.addEventListener("keydown", (event) => { if (event.key === "Enter") options.onSelect(step, index); });
        }
        return figure;
      })));
  }));
}

// The header of a selected step's numbers: name, kind, shape, size, note.
function stepHeader(step) {
  const count = elements(step.shape).toLocaleString("en");
  return [el("h3", {}, `${step.name} `, el("small", {}, `${step.kind}, ${shapeText(step.shape)}: ${count} ${step.kind === "weight" ? "parameters" : "numbers"}`)),
    step.note ? el("p", { class: "note" }, step.note) : ""];
}

// After the page has drawn: a deep link's click=NAME clicks that block, as a person would.
function clickRequested(container) {
  const name = new URLSearchParams(location.search).get("click");
  if (!name) return;
  const target = [...container.querySelectorAll("figure.shape-block")].find((f) => f.dataset.name === name);
  if (target) target.dispatchEvent(new MouseEvent("click", { bubbles: true }));
}
